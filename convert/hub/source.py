"""Fetching a Hub source: ``resolve_source("org/name@rev", download_dir, token)``.

``resolve_source`` turns a ``SOURCE`` argument into a local checkpoint directory and the commit
sha it came from. An existing path always wins; otherwise the argument must look like a Hub repo
id. Only the files a conversion reads are fetched, in two steps: config.json, the index and the
small companions (tokenizer, generation config, remote code, license, model card) first; then
exactly the shards that index names. Files land in the normal HF cache, or as plain files in
``download_dir``. With ``HF_HUB_OFFLINE=1`` nothing is requested and a file missing from the
cache is a :class:`HetquantError` naming it.

What is converted is always a commit the Hub named (issue #25 §3). Online, the revision is
resolved to its commit sha first (``repo_info``); a Hub that cannot be reached (no connection,
a timeout, a 5xx answer) is refused, not answered with whatever a local copy holds —
huggingface_hub's own fallback, which returns a non-empty ``download_dir`` unchecked and with no
revision. Offline use is explicit: with ``HF_HUB_OFFLINE=1`` the copy is used as it is, and its
revision is the one recorded beside it (the cache's ``snapshots/<sha>``; in ``download_dir``,
huggingface_hub's ``.cache/huggingface/download/<file>.metadata``). In ``download_dir`` every file
read must carry that record, all of one commit — the requested one when a sha was asked for — or
the copy is refused (files put there by hand, or left from another revision).
"""

from __future__ import annotations

import glob
import logging
import re
from pathlib import Path, PurePosixPath
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import INDEX_NAME, SINGLE_NAME
from hetquant.formats.json_io import load_json

from ..planning.aux_files import WEIGHT_SUFFIXES
from .common import _first_line, hub_endpoint, hub_offline

__all__ = ["SOURCE_META_IGNORE", "parse_repo_spec", "resolve_source"]

log = logging.getLogger("hetquant.hub")

# What a conversion reads besides the shards: every top-level file that is not a weight. The
# artifact carries the small ones (convert/planning/aux_files.py: tokenizers in any form, chat templates,
# remote code); publish reads the source's model card for its licence and base model. Patterns
# are fnmatch'ed against repository paths, where "*" also matches "/": "*/*" is every file in a
# sub-directory (other checkpoints, figures, inference code), left on the Hub.
SOURCE_META_IGNORE = ("*/*", ".*", *(f"*{s}" for s in WEIGHT_SUFFIXES))

# huggingface_hub's validate_repo_id, plus an optional "@revision" (which may contain "/").
_REPO_SPEC = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:@(?P<rev>[^\s@]+))?$"
)
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


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
    asked = revision
    if not offline:  # the commit the Hub names now; refused when it cannot say
        revision = _resolve_commit(repo_id, revision, token, where, download_dir)
    # Step 1: the small files, which say which shards exist.
    root = _snapshot(repo_id, revision, None, download_dir, token, offline)
    sha = _commit_of(root, download_dir) if offline else revision
    if not (root / "config.json").is_file():
        raise _missing(where, ["config.json"], offline, root)
    shards = _shards_named(root, where)
    # Step 2: exactly those shards, at the commit step 1 resolved (a moving branch can't mix),
    # into the same snapshot folder.
    patterns = [glob.escape(s) for s in shards]
    root = _snapshot(repo_id, sha or revision, patterns, download_dir, token, offline)
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        raise _missing(where, missing, offline, root)
    if download_dir is not None:
        files = ["config.json", *([INDEX_NAME] if (root / INDEX_NAME).is_file() else []), *shards]
        sha = _check_recorded(root, files, sha, asked, where)
    log.info("source %s at commit %s: %d shards in %s", repo_id, sha, len(shards), root)
    return root, sha


def _resolve_commit(
    repo_id: str, revision: str | None, token: str | None, where: str, download_dir: Path | None
) -> str:
    """The commit sha ``revision`` names on the Hub now; a Hub that cannot answer is refused."""
    from huggingface_hub import HfApi, errors

    try:
        info = HfApi(endpoint=hub_endpoint(), token=token).repo_info(repo_id, revision=revision)
    except Exception as e:  # every failure of the client becomes one clear line
        known = (
            errors.RepositoryNotFoundError,
            errors.GatedRepoError,
            errors.RevisionNotFoundError,
        )
        status = getattr(getattr(e, "response", None), "status_code", None)
        http = isinstance(e, errors.HfHubHTTPError) and status is not None and status < 500
        if isinstance(e, known) or http:
            raise _hub_error(e, where, False, token) from None
        copy = f"the copy in {download_dir}" if download_dir is not None else "the cached copy"
        raise HetquantError(
            f"{where}: the Hub could not be reached to resolve the revision "
            f"({type(e).__name__}: {_first_line(e, token)}); retry with network access, or set "
            f"HF_HUB_OFFLINE=1 to convert {copy} as it is"
        ) from None
    if not isinstance(info.sha, str) or not _COMMIT_SHA.match(info.sha):
        raise HetquantError(f"{where}: the Hub named no commit for this revision")
    return info.sha


def _check_recorded(
    root: Path, files: list[str], sha: str | None, asked: str | None, where: str
) -> str:
    """The one commit every file of ``files`` in ``download_dir`` records (module docstring)."""
    recorded = {f: _recorded_commit(root, f) for f in files}
    unknown = [f for f, c in recorded.items() if c is None]
    if unknown:
        raise HetquantError(
            f"{where}: {root} holds {unknown[0]} with no record of the commit it came from "
            f"(huggingface_hub's .cache/huggingface/download/); not a Hub download — pass "
            f"{root} as a local directory SOURCE, or download again with network access"
        )
    want = sha or recorded["config.json"]
    if asked is not None and _COMMIT_SHA.match(asked) and asked != want:
        raise HetquantError(
            f"{where}: {root} holds commit {want}, not the requested {asked}; download it again "
            "with network access (unset HF_HUB_OFFLINE)"
        )
    other = next((f for f, c in recorded.items() if c != want), None)
    if other is not None:
        raise HetquantError(
            f"{where}: {root} mixes revisions: {other} is from commit {recorded[other]}, not "
            f"{want}; download again with network access (unset HF_HUB_OFFLINE)"
        )
    return want  # type: ignore[return-value]  (no record: refused above)


def _snapshot(
    repo_id: str,
    revision: str | None,
    patterns: list[str] | None,
    download_dir: Path | None,
    token: str | None,
    offline: bool,
) -> Path:
    from huggingface_hub import snapshot_download

    kwargs: dict[str, Any] = {
        "revision": revision,
        "allow_patterns": patterns,  # None: the small files of step 1
        "ignore_patterns": list(SOURCE_META_IGNORE) if patterns is None else None,
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
    return _recorded_commit(root, "config.json")


def _recorded_commit(root: Path, file: str) -> str | None:
    """The commit huggingface_hub (≥ 0.23) recorded for ``file`` downloaded into local dir
    ``root`` ("<commit>\n<etag>\n<time>" in .cache/huggingface/download/<file>.metadata)."""
    meta = root / ".cache" / "huggingface" / "download" / f"{file}.metadata"
    try:
        first = meta.read_text().split("\n", 1)[0].strip()
    except (OSError, UnicodeDecodeError):
        return None
    return first if _COMMIT_SHA.match(first) else None


def _shards_named(root: Path, where: str) -> list[str]:
    index = root / INDEX_NAME
    if not index.is_file():
        return [SINGLE_NAME]  # a one-file checkpoint, or the clear "neither" error later
    try:
        weight_map = load_json(index)["weight_map"]
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
