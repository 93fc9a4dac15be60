"""The Hugging Face Hub side of hetquant: fetching a source, checking and uploading an artifact.

``resolve_source("org/name@rev", download_dir, token)`` turns a ``SOURCE`` argument into a local
checkpoint directory and the commit sha it came from. An existing path always wins; otherwise
the argument must look like a Hub repo id. Only the files a conversion reads are fetched, in two
steps: config.json, the index and the small companions (tokenizer, generation config, remote
code, license, model card) first; then exactly the shards that index names. Files land in the
normal HF cache, or as plain files in ``download_dir``. With ``HF_HUB_OFFLINE=1`` nothing is
requested and a file missing from the cache is a :class:`HetquantError` naming it.

``upload_artifact`` creates the repo (``exist_ok``), creates the branch when one is named, and
uploads the artifact's files plus a generated README.md with ``upload_folder``: on
huggingface_hub ≥ 1.20 with hf_xet (the default install) a streamed, multi-commit, resumable
upload; on the legacy LFS path one commit whose already-uploaded objects are not sent again.
Unchanged files are never re-committed, so re-running after an interruption resumes, and
re-running after success makes no commit. ``check_hub_limits`` applies the Hub's limits
(reference/hub_cli.md §1.8) before anything is sent.

The token is passed through to huggingface_hub and never printed, logged or put in a message.
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read when a function runs (huggingface_hub reads them
once, at import), so setting them later in the same process still takes effect.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from hetquant.formats import HetquantError

__all__ = [
    "FOLDER_ENTRIES_MAX",
    "HARD_FILE_BYTES",
    "PRIVATE_FREE_BYTES",
    "RECOMMENDED_FILE_BYTES",
    "REPO_FILES_RECOMMENDED",
    "SOURCE_META_PATTERNS",
    "LimitReport",
    "UploadResult",
    "check_hub_limits",
    "hub_endpoint",
    "hub_offline",
    "parse_repo_spec",
    "redact",
    "resolve_source",
    "upload_artifact",
]

log = logging.getLogger("hetquant.hub")

INDEX_NAME = "model.safetensors.index.json"  # same names as convert/source.py
SINGLE_NAME = "model.safetensors"

# What a conversion reads besides the shards: engine.AUX_PATTERNS (copied into the artifact),
# plus the source's model card, which tells `hetquant publish` the license and base model.
SOURCE_META_PATTERNS = (
    "config.json", INDEX_NAME, "README.md",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "generation_config.json", "configuration_*.py", "modeling_*.py", "LICENSE*",
)  # fmt: skip

# Hub limits (hub-docs storage-limits.md, Aug 2026; reference/hub_cli.md §1.8). Decimal units.
FOLDER_ENTRIES_MAX = 10_000  # hard: "the maximum number of files per folder cannot exceed 10k"
REPO_FILES_RECOMMENDED = 100_000
RECOMMENDED_FILE_BYTES = 200 * 10**9
HARD_FILE_BYTES = 500 * 10**9
PRIVATE_FREE_BYTES = 100 * 10**9  # private storage of a free account

# huggingface_hub's validate_repo_id, plus an optional "@revision" (which may contain "/").
_REPO_SPEC = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:@(?P<rev>[^\s@]+))?$"
)
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


def hub_endpoint() -> str | None:
    """``HF_ENDPOINT`` as set now (None: huggingface_hub's default)."""
    value = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    return value or None


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, now or at import."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def redact(text: str, token: str | None) -> str:
    """``text`` with ``token`` (and anything shaped like an HF token) replaced by ``***``."""
    if token:
        text = text.replace(token, "***")
    return re.sub(r"hf_[A-Za-z0-9]{20,}", "hf_***", text)


def _first_line(e: BaseException, token: str | None) -> str:
    lines = str(e).strip().splitlines()
    return redact(lines[0] if lines else type(e).__name__, token)


# source -------------------------------------------------------------------------------------------
def parse_repo_spec(spec: str) -> tuple[str, str | None] | None:
    """``("org/name", "rev" | None)`` when ``spec`` reads as a Hub repo id, else None."""
    m = _REPO_SPEC.match(spec)
    if m is None:
        return None
    repo = m["repo"]
    if "--" in repo or ".." in repo or repo.endswith(".git") or re.search(r"[.-](/|$)", repo):
        return None
    return repo, m["rev"]


def resolve_source(
    spec: str, download_dir: Path | None = None, token: str | None = None
) -> tuple[Path, str | None]:
    """A local checkpoint directory for ``spec`` and the commit sha it came from.

    ``spec`` is a local directory (returned as it is, revision None) or ``org/name[@revision]``.
    An existing path wins over a repo id of the same spelling.
    """
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise HetquantError(f"{spec}: SOURCE is a file; give the checkpoint directory")
        return path, None
    parsed = parse_repo_spec(spec)
    if parsed is None:
        raise HetquantError(
            f"{spec}: SOURCE is neither an existing directory nor a Hub repo id "
            "(org/name or org/name@revision)"
        )
    repo_id, revision = parsed
    return _download(repo_id, revision, download_dir, token)


def _download(
    repo_id: str, revision: str | None, download_dir: Path | None, token: str | None
) -> tuple[Path, str | None]:
    offline = hub_offline()
    where = f"{repo_id}@{revision or 'main'}"
    log.info("fetching %s%s", where, " from the local cache (offline)" if offline else "")
    # Step 1: the small files, which say which shards exist.
    root = _snapshot(repo_id, revision, list(SOURCE_META_PATTERNS), download_dir, token, offline)
    sha = _commit_of(root, download_dir)
    if not (root / "config.json").is_file():
        raise _missing(where, ["config.json"], offline, root)
    shards = _shards_named(root, where)
    # Step 2: exactly those shards, at the commit step 1 resolved (a moving branch can't mix).
    patterns = [*SOURCE_META_PATTERNS, *(glob.escape(s) for s in shards)]
    root = _snapshot(repo_id, sha or revision, patterns, download_dir, token, offline)
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        raise _missing(where, missing, offline, root)
    log.info("source %s at commit %s: %d shards in %s", repo_id, sha, len(shards), root)
    return root, sha


def _snapshot(
    repo_id: str,
    revision: str | None,
    patterns: list[str],
    download_dir: Path | None,
    token: str | None,
    offline: bool,
) -> Path:
    from huggingface_hub import snapshot_download

    kwargs: dict[str, Any] = {
        "revision": revision,
        "allow_patterns": patterns,
        "token": token,
        "local_files_only": offline,
    }
    if download_dir is not None:
        kwargs["local_dir"] = str(download_dir)
    if (endpoint := hub_endpoint()) is not None:
        kwargs["endpoint"] = endpoint
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except Exception as e:  # every failure of the client becomes one clear line
        raise _hub_error(e, f"{repo_id}@{revision or 'main'}", offline, token) from e


def _commit_of(root: Path, download_dir: Path | None) -> str | None:
    """The commit sha the snapshot at ``root`` was taken from."""
    if download_dir is None:
        return root.name if _COMMIT_SHA.match(root.name) else None  # cache: snapshots/<sha>
    # local_dir: huggingface_hub (≥ 0.23) keeps "<commit>\n<etag>\n<time>" per downloaded file.
    meta = root / ".cache" / "huggingface" / "download" / "config.json.metadata"
    try:
        first = meta.read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return first if _COMMIT_SHA.match(first) else None


def _shards_named(root: Path, where: str) -> list[str]:
    index = root / INDEX_NAME
    if not index.is_file():
        return [SINGLE_NAME]  # a one-file checkpoint, or the clear "neither" error later
    try:
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HetquantError(f"{where}: {INDEX_NAME} is not a valid index ({e})") from None
    for f in files:
        p = PurePosixPath(f) if isinstance(f, str) else None
        if p is None or not f or p.is_absolute() or ".." in p.parts or "\\" in f:
            raise HetquantError(
                f"{where}: {INDEX_NAME} names shard {f!r}, outside the repository; refusing it"
            )
    return files


def _missing(where: str, names: list[str], offline: bool, root: Path) -> HetquantError:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if offline:
        return HetquantError(
            f"{where}: HF_HUB_OFFLINE is set and {shown} is not in the local copy ({root}); "
            "run once with network access (unset HF_HUB_OFFLINE) or pass a local directory"
        )
    return HetquantError(f"{where}: the repository has no {shown}; is it an HF checkpoint?")


def _hub_error(e: Exception, what: str, offline: bool, token: str | None) -> HetquantError:
    from huggingface_hub import errors

    name = type(e).__name__
    first = _first_line(e, token)
    if isinstance(e, errors.GatedRepoError):
        return HetquantError(
            f"{what}: gated repository; accept its terms on the Hub and pass a token (HF_TOKEN or --token)"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return HetquantError(
            f"{what}: repository not found on the Hub, or private and the token can't read it"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return HetquantError(f"{what}: no such revision (branch, tag or commit) in the repository")
    if isinstance(e, errors.LocalEntryNotFoundError) or offline:
        if offline:
            return HetquantError(
                f"{what}: HF_HUB_OFFLINE is set and the files are not (all) in the local cache: {first}; "
                "run once with network access (unset HF_HUB_OFFLINE) or pass a local directory"
            )
        return HetquantError(
            f"{what}: the Hub could not be reached and no local copy exists: {first}"
        )
    if isinstance(e, errors.HfHubHTTPError):
        return HetquantError(f"{what}: the Hub answered an error: {first}")
    return HetquantError(f"{what}: {name}: {first}")


# limits -------------------------------------------------------------------------------------------
@dataclass
class LimitReport:
    """What the Hub would refuse (``errors``) and what it advises against (``warnings``)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_hub_limits(
    sizes: dict[str, int], index: dict[str, Any] | None, *, private: bool = False
) -> LimitReport:
    """Check the files to upload (repo path → bytes) and the root index against the Hub's limits.

    ``index`` is the parsed ``model.safetensors.index.json`` (None when there is none).
    """
    rep = LimitReport()
    entries: set[PurePosixPath] = set()  # every file and every folder above one
    for name in sizes:
        p = PurePosixPath(name)
        entries.add(p)
        entries.update(q for q in p.parents if q != PurePosixPath("."))
    per_folder = Counter(str(e.parent) for e in entries)
    for folder, n in sorted(per_folder.items()):
        if n >= FOLDER_ENTRIES_MAX:
            rep.errors.append(
                f"{'the repository root' if folder == '.' else folder}: {n:,} entries; the Hub allows fewer than "
                f"{FOLDER_ENTRIES_MAX:,} per folder — split it into sub-folders"
            )
    if len(sizes) >= REPO_FILES_RECOMMENDED:
        rep.warnings.append(
            f"{len(sizes):,} files; the Hub recommends fewer than {REPO_FILES_RECOMMENDED:,} per repository"
        )
    for name, size in sorted(sizes.items()):
        if size > HARD_FILE_BYTES:
            rep.errors.append(
                f"{name}: {size / 1e9:,.1f} GB; the Hub refuses files over {HARD_FILE_BYTES / 1e9:.0f} GB — "
                "convert again with a smaller --max-shard-size"
            )
        elif size > RECOMMENDED_FILE_BYTES:
            rep.warnings.append(
                f"{name}: {size / 1e9:,.1f} GB; the Hub recommends files under {RECOMMENDED_FILE_BYTES / 1e9:.0f} GB"
            )
    rep.errors += _index_problems(sizes, index)
    total = sum(sizes.values())
    if private and total > PRIVATE_FREE_BYTES:
        rep.warnings.append(
            f"{total / 1e9:,.1f} GB private: a free account has {PRIVATE_FREE_BYTES / 1e9:.0f} GB of "
            "private storage (PRO/Team/Enterprise have more)"
        )
    return rep


def _index_problems(sizes: dict[str, int], index: dict[str, Any] | None) -> list[str]:
    root_shards = {n for n in sizes if "/" not in n and n.endswith(".safetensors")}
    if index is None:
        if len(root_shards) > 1 or (root_shards and root_shards != {SINGLE_NAME}):
            return [
                f"{INDEX_NAME} missing: root shards {', '.join(sorted(root_shards))} are unindexed"
            ]
        return []
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        return [f"{INDEX_NAME}: no weight_map"]
    named = {f for f in wm.values() if isinstance(f, str)}
    out = [
        f"{INDEX_NAME} names {f}, which is not among the files to upload"
        for f in sorted(named - set(sizes))
    ]
    out += [
        f"{f}: root shard not named in {INDEX_NAME} (the index does not cover it)"
        for f in sorted(root_shards - named)
    ]
    return out


# upload -------------------------------------------------------------------------------------------
@dataclass
class UploadResult:
    repo_url: str
    revision: str
    commit_oid: str | None
    commit_url: str | None
    pr_url: str | None
    changed: bool
    private: bool | None


def upload_artifact(
    artifact: Path,
    repo_id: str,
    files: list[str],
    readme: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    token: str | None = None,
    commit_message: str = "Upload artifact with hetquant",
) -> UploadResult:
    """Upload ``files`` (paths relative to ``artifact``) and ``readme`` as README.md to ``repo_id``.

    The artifact directory is not modified: the upload is staged as symbolic links in a temporary
    directory. Re-running resumes an interrupted upload and makes no commit when nothing changed.
    """
    from huggingface_hub import HfApi, errors

    if hub_offline():
        raise HetquantError("HF_HUB_OFFLINE is set; publishing needs the network — unset it")
    if create_pr and revision not in (None, "main"):
        raise HetquantError(
            "--create-pr opens the pull request against main; drop --revision (or --create-pr)"
        )
    branch = revision or "main"
    api = HfApi(endpoint=hub_endpoint(), token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True, repo_type="model")
        info = api.repo_info(repo_id, revision=branch, repo_type="model")
        before, is_private = info.sha, getattr(info, "private", None)
        with tempfile.TemporaryDirectory(prefix="hetquant-publish-") as stage:
            _stage(artifact, files, readme, Path(stage))
            commit = api.upload_folder(
                repo_id=repo_id,
                folder_path=stage,
                repo_type="model",
                revision=None if create_pr else branch,
                create_pr=create_pr or None,
                commit_message=commit_message,
            )
    except HetquantError:
        raise
    except errors.HfHubHTTPError as e:
        raise _publish_error(e, repo_id, token) from e
    except Exception as e:  # network errors of either HTTP stack, client-side validation
        raise HetquantError(
            f"{repo_id}: upload failed: {type(e).__name__}: {_first_line(e, token)}; "
            "re-run the same command to resume"
        ) from e
    oid = getattr(commit, "oid", None)
    pr_url = getattr(commit, "pr_url", None)
    changed = pr_url is not None or (oid is not None and oid != before)
    return UploadResult(
        repo_url=str(url),
        revision=branch,
        commit_oid=oid,
        commit_url=getattr(commit, "commit_url", None),
        pr_url=pr_url,
        changed=changed,
        private=is_private,
    )


def _stage(artifact: Path, files: list[str], readme: str, stage: Path) -> None:
    artifact = artifact.resolve()
    for name in files:
        src = artifact / name
        dst = stage / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(src, dst)
    card = stage / "README.md"
    if card.is_symlink():  # never write through a link into the artifact
        card.unlink()
    card.write_text(readme, encoding="utf-8")


def _publish_error(e: Exception, repo_id: str, token: str | None) -> HetquantError:
    from huggingface_hub import errors

    status = getattr(getattr(e, "response", None), "status_code", None)
    first = _first_line(e, token)
    if status == 401:
        return HetquantError(
            f"{repo_id}: the Hub refused the token (401); set HF_TOKEN or pass --token with a write token"
        )
    if status == 403:
        return HetquantError(
            f"{repo_id}: the token may not write to this namespace (403); use a write token of its owner"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return HetquantError(f"{repo_id}: repository not found, or the token can't access it")
    return HetquantError(f"{repo_id}: the Hub answered an error: {first}; re-run to resume")
