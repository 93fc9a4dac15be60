"""A loopback fake of the Hugging Face Hub: the routes huggingface_hub's client uses, no more.

Standard library only; listens on 127.0.0.1, port 0, in a daemon thread. It implements what
``whoami``, ``create_repo``, ``create_branch``, ``repo_info``, ``list_repo_tree``, ``upload_folder`` on the
legacy (non-xet) path — README validation, preupload, LFS batch + basic PUT, NDJSON commit, pull
requests — and ``snapshot_download`` / ``hf_hub_download`` need, with the Hub's wire formats as
huggingface_hub 2.4.0 (and 0.36 / 1.x) read them. Run the client with ``HF_HUB_DISABLE_XET=1``:
the xet transfer protocol is not faked.

Every request is recorded in ``hub.requests`` (method, path, query, Authorization header), so a
test can assert what reached the server — or that nothing did.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeHub", "Request"]

LFS_EXTENSIONS = (".safetensors", ".bin", ".pt", ".gguf")
LFS_MIN_SIZE = 1 << 20  # larger files go to LFS whatever their name (the Hub: >10 MB)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None


@dataclass
class Blob:
    content: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def git_sha1(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()

    @property
    def etag(self) -> str:  # what the client compares: sha256 for LFS, git blob sha1 otherwise
        return self.sha256 if self.lfs else self.git_sha1


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # sha → tree
    refs: dict[str, str] = field(default_factory=dict)  # branch / refs/pr/N → sha
    log: list[str] = field(default_factory=list)  # commit shas in creation order
    pulls: list[str] = field(default_factory=list)


class FakeHub:
    """``with FakeHub(token="hf_x") as hub: ... hub.endpoint ...``; state is plain attributes."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token  # when set, writes need "Bearer <token>"; private reads too
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 → content uploaded, not yet committed
        self.requests: list[Request] = []
        self.fail_commits = 0  # the next N commits fail (an interrupted upload)
        self.user, self.token_role = "hetquant-test", "write"  # whoami's answer ("read", ...)
        self.lock = threading.RLock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    # helpers for tests -------------------------------------------------------------------------
    def commit_count(self, repo_id: str) -> int:
        return len(self.repos[repo_id].log)

    def head(self, repo_id: str, ref: str = "main") -> str:
        return self.repos[repo_id].refs[ref]

    def files(self, repo_id: str, ref: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {p: b.content for p, b in repo.commits[repo.refs[ref]].items()}

    def seed(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> str:
        """Create ``repo_id`` with one commit of ``files``; returns the commit sha."""
        with self.lock:
            repo = self.repos.setdefault(repo_id, self._new_repo(repo_id, private))
            tree = dict(repo.commits[repo.refs["main"]])
            for path, data in files.items():
                tree[path] = Blob(data, _is_lfs(path, len(data)))
            return self._commit(repo, "main", tree, "seed")

    # state changes -----------------------------------------------------------------------------
    def _new_repo(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id, private)
        gitattributes = Blob(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False)
        self._commit(repo, "main", {".gitattributes": gitattributes}, "initial commit")
        return repo

    def _commit(self, repo: Repo, ref: str, tree: dict[str, Blob], summary: str) -> str:
        parent = repo.refs.get(ref, "")
        listing = sorted((p, b.etag) for p, b in tree.items())
        sha = hashlib.sha1(json.dumps([parent, summary, listing]).encode()).hexdigest()
        repo.commits[sha] = tree
        repo.refs[ref] = sha
        repo.log.append(sha)
        return sha


def _is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_EXTENSIONS) or size >= LFS_MIN_SIZE


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Error(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output clean
            pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        # plumbing ------------------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(
            self, status: int, body: bytes | Any = b"", headers: dict[str, str] | None = None
        ) -> None:
            if not isinstance(body, bytes):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            # One request per connection: a client's pooled keep-alive connection must never
            # outlive this hub and reach a later test's hub that happens to get the same port.
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            auth = self.headers.get("Authorization")
            with hub.lock:
                hub.requests.append(Request(method, url.path, parse_qs(url.query), auth))
            body = self._body() if method in ("POST", "PUT") else b""
            try:
                with hub.lock:
                    self._route(method, url.path, parse_qs(url.query), body, auth)
            except _Error as e:
                headers = {"X-Error-Message": e.message}
                if e.code:
                    headers["X-Error-Code"] = e.code
                self._send(e.status, {"error": e.message}, headers)

        def _need_write(self, auth: str | None) -> None:
            if hub.token is not None and auth != f"Bearer {hub.token}":
                raise _Error(401, "Invalid credentials in Authorization header")

        def _repo(self, ns: str, name: str, auth: str | None) -> Repo:
            repo = hub.repos.get(f"{ns}/{name}")
            if repo is None or (
                repo.private and hub.token is not None and auth != f"Bearer {hub.token}"
            ):
                raise _Error(404, "Repository not found", "RepoNotFound")
            return repo

        def _rev(self, repo: Repo, rev: str) -> str:
            rev = unquote(rev)
            if rev in repo.refs:
                return repo.refs[rev]
            if rev in repo.commits:
                return rev
            raise _Error(404, f"Invalid rev id: {rev}", "RevisionNotFound")

        # routes --------------------------------------------------------------------------------
        def _route(
            self, method: str, path: str, q: dict[str, list[str]], body: bytes, auth: str | None
        ) -> None:
            seg = [unquote(s) for s in path.strip("/").split("/")]
            if path == "/api/agent-harnesses":
                return self._send(200, {"standardEnvVars": [], "harnesses": {}})
            if method == "GET" and path == "/api/whoami-v2":
                return self._whoami(auth)
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body))
            if method == "POST" and path == "/api/repos/create":
                self._need_write(auth)
                return self._create_repo(json.loads(body))
            if seg[:2] == ["api", "models"] and len(seg) >= 4:
                ns, name, rest = seg[2], seg[3], seg[4:]
                if method == "GET" and rest[:1] == ["revision"] and len(rest) >= 2:
                    return self._repo_info(self._repo(ns, name, auth), "/".join(rest[1:]))
                if method == "GET" and not rest:
                    return self._repo_info(self._repo(ns, name, auth), "main")
                if method == "GET" and rest[:1] == ["tree"] and len(rest) >= 2:
                    return self._tree(self._repo(ns, name, auth), rest[1], "/".join(rest[2:]))
                if method == "POST" and rest[:1] == ["branch"] and len(rest) >= 2:
                    self._need_write(auth)
                    return self._branch(self._repo(ns, name, auth), "/".join(rest[1:]), body)
                if method == "POST" and rest[:1] == ["preupload"] and len(rest) >= 2:
                    self._need_write(auth)
                    return self._preupload(self._repo(ns, name, auth), "/".join(rest[1:]), body, q)
                if method == "POST" and rest[:1] == ["commit"] and len(rest) >= 2:
                    self._need_write(auth)
                    return self._commit(self._repo(ns, name, auth), "/".join(rest[1:]), body, q)
            if (
                method == "POST"
                and len(seg) == 6
                and seg[1].endswith(".git")
                and seg[2:] == ["info", "lfs", "objects", "batch"]
            ):
                self._need_write(auth)
                return self._lfs_batch(self._repo(seg[0], seg[1][: -len(".git")], auth), body)
            if method == "PUT" and seg[:1] == ["_lfs"] and len(seg) == 2:
                return self._lfs_put(seg[1], body)
            if method in ("GET", "HEAD") and len(seg) >= 5 and seg[2] == "resolve":
                return self._resolve(self._repo(seg[0], seg[1], auth), seg[3], "/".join(seg[4:]))
            raise _Error(404, f"fake hub: no route for {method} {path}")

        def _validate_yaml(self, doc: dict[str, Any]) -> None:
            content = doc.get("content", "")
            errors = []
            if content.startswith("---"):
                try:
                    import yaml

                    meta = yaml.safe_load(content[3 : content.index("\n---", 3)])
                    if meta is not None and not isinstance(meta, dict):
                        errors.append("metadata is not a mapping")
                except Exception as e:  # any YAML error: the Hub answers 400
                    errors.append(f"invalid YAML: {e}")
            if errors:
                raise _Error(400, "; ".join(errors))
            self._send(200, {"errors": [], "warnings": []})

        def _whoami(self, auth: str | None) -> None:
            """The token's owner and role, as the Hub answers ``/api/whoami-v2``; 401 without a
            valid token (the Hub answers 401 to a missing or unknown one)."""
            if auth is None or (hub.token is not None and auth != f"Bearer {hub.token}"):
                raise _Error(401, "Invalid credentials in Authorization header")
            role = {"displayName": "fake", "role": hub.token_role}
            self._send(
                200,
                {
                    "type": "user",
                    "name": hub.user,
                    "orgs": [],
                    "auth": {"type": "access_token", "accessToken": role},
                },
            )

        def _create_repo(self, doc: dict[str, Any]) -> None:
            repo_id = f"{doc.get('organization')}/{doc['name']}"
            if repo_id in hub.repos:  # the Hub's 409 carries the url; exist_ok clients read it
                msg = "You already created this model repo"
                return self._send(
                    409,
                    {"error": msg, "url": f"{hub.endpoint}/{repo_id}"},
                    {"X-Error-Message": msg},
                )
            private = doc.get("visibility") == "private" or bool(doc.get("private"))
            hub.repos[repo_id] = hub._new_repo(repo_id, private)
            self._send(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})

        def _repo_info(self, repo: Repo, rev: str) -> None:
            sha = self._rev(repo, rev)
            siblings = [{"rfilename": p} for p in sorted(repo.commits[sha])]
            self._send(
                200,
                {
                    "id": repo.repo_id,
                    "modelId": repo.repo_id,
                    "sha": sha,
                    "private": repo.private,
                    "siblings": siblings,
                    "tags": [],
                },
            )

        def _tree(self, repo: Repo, rev: str, prefix: str) -> None:
            sha = self._rev(repo, rev)
            entries, dirs = [], set()
            for p, b in sorted(repo.commits[sha].items()):
                if prefix and not p.startswith(prefix.rstrip("/") + "/"):
                    continue
                parts = p.split("/")
                for i in range(1, len(parts)):
                    dirs.add("/".join(parts[:i]))
                entry = {"type": "file", "path": p, "size": len(b.content), "oid": b.git_sha1}
                if b.lfs:
                    entry["lfs"] = {"oid": b.sha256, "size": len(b.content), "pointerSize": 134}
                entries.append(entry)
            entries += [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in dirs]
            self._send(200, entries)

        def _branch(self, repo: Repo, branch: str, body: bytes) -> None:
            if branch in repo.refs:
                raise _Error(409, f"Branch {branch} already exists")
            start = (json.loads(body or b"{}") or {}).get("startingPoint") or "main"
            repo.refs[branch] = self._rev(repo, start)
            self._send(200, {})

        def _preupload(self, repo: Repo, rev: str, body: bytes, q: dict[str, list[str]]) -> None:
            head = repo.commits[self._rev(repo, "main" if q.get("create_pr") else rev)]
            out = []
            for f in json.loads(body)["files"]:
                lfs = _is_lfs(f["path"], f["size"])
                remote = head.get(f["path"])
                out.append(
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": remote.etag if remote is not None and remote.lfs == lfs else None,
                    }
                )
            self._send(200, {"files": out, "commitOid": self._rev(repo, rev)})

        def _lfs_batch(self, repo: Repo, body: bytes) -> None:
            doc = json.loads(body)
            known = {b.sha256 for tree in repo.commits.values() for b in tree.values() if b.lfs}
            objects = []
            for o in doc["objects"]:
                obj: dict[str, Any] = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in known and o["oid"] not in hub.lfs:  # else: already stored
                    obj["actions"] = {"upload": {"href": f"{hub.endpoint}/_lfs/{o['oid']}"}}
                objects.append(obj)
            self._send(200, {"transfer": "basic", "objects": objects})

        def _lfs_put(self, oid: str, body: bytes) -> None:
            if hashlib.sha256(body).hexdigest() != oid:
                raise _Error(400, "sha256 of the uploaded bytes does not match the oid")
            hub.lfs[oid] = body
            self._send(200, b"")

        def _commit(self, repo: Repo, rev: str, body: bytes, q: dict[str, list[str]]) -> None:
            if hub.fail_commits > 0:
                hub.fail_commits -= 1
                raise _Error(400, "simulated failure: the connection dropped before the commit")
            lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            create_pr = q.get("create_pr") == ["1"]
            base = self._rev(repo, rev)
            if "parentCommit" in header and header["parentCommit"] != base:
                raise _Error(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[base])
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    tree[v["path"]] = Blob(base64.b64decode(v["content"]), False)
                elif x["key"] == "lfsFile":
                    known = {b.sha256: b for t in repo.commits.values() for b in t.values()}
                    if v["oid"] in hub.lfs:
                        data = hub.lfs[v["oid"]]
                    elif v["oid"] in known:
                        data = known[v["oid"]].content
                    else:
                        raise _Error(422, f"LFS object {v['oid']} was never uploaded")
                    tree[v["path"]] = Blob(data, True)
                elif x["key"] == "deletedFile":
                    tree.pop(v["path"], None)
            ref = unquote(rev)
            pr_url = None
            if create_pr:
                ref = f"refs/pr/{len(repo.pulls) + 1}"
                repo.refs[ref] = base
                repo.pulls.append(ref)
                pr_url = f"{hub.endpoint}/{repo.repo_id}/discussions/{len(repo.pulls)}"
            elif ref not in repo.refs:
                ref = next((r for r, s in repo.refs.items() if s == base), "main")
            sha = hub._commit(repo, ref, tree, header.get("summary", ""))
            self._send(
                200,
                {
                    "commitUrl": f"{hub.endpoint}/{repo.repo_id}/commit/{sha}",
                    "commitOid": sha,
                    "pullRequestUrl": pr_url,
                },
            )

        def _resolve(self, repo: Repo, rev: str, path: str) -> None:
            sha = self._rev(repo, rev)
            blob = repo.commits[sha].get(path)
            if blob is None:
                raise _Error(404, "Entry not found", "EntryNotFound")
            headers = {
                "X-Repo-Commit": sha,
                "ETag": f'"{blob.etag}"',
                "Content-Type": "application/octet-stream",
            }
            if blob.lfs:
                headers["X-Linked-Etag"] = f'"{blob.sha256}"'
                headers["X-Linked-Size"] = str(len(blob.content))
            self._send(200, blob.content, headers)

    return Handler
