"""Publishing an artifact to the Hub: ``upload_artifact``.

``upload_artifact`` creates the repo (``exist_ok``), creates the branch when one is named, and
uploads the artifact's files plus a generated README.md with ``upload_folder``: on
huggingface_hub ≥ 1.20 with hf_xet (the default install) a streamed, multi-commit, resumable
upload; on the legacy LFS path one commit whose already-uploaded objects are not sent again.
Unchanged files are never re-committed, so re-running after an interruption resumes, and
re-running after success makes no commit. Check the files first with
:func:`hetquant.convert.hub.limits.check_hub_limits`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hetquant.formats import HetquantError
from hetquant.formats.safe_paths import inside

from .common import _first_line, hub_endpoint, hub_offline

__all__ = ["UploadResult", "check_credentials", "upload_artifact"]


@dataclass
class UploadResult:
    repo_url: str
    revision: str
    commit_oid: str | None
    commit_url: str | None
    pr_url: str | None
    changed: bool
    private: bool | None


def check_credentials(token: str | None) -> str | None:
    """The Hub user the token belongs to, checked before anything is sent or verified.

    Refuses (HetquantError): HF_HUB_OFFLINE set; no token (``token``, ``$HF_TOKEN`` or the saved
    login); a token the Hub rejects (401) or marks read-only; a Hub that cannot be reached. A
    rate-limited ``whoami`` (429) is not a verdict on the token: the upload goes ahead.
    """
    from huggingface_hub import HfApi, constants, errors, get_token

    if hub_offline():
        raise HetquantError("HF_HUB_OFFLINE is set; publishing needs the network — unset it")
    token = token or get_token()
    if not token:
        raise HetquantError(
            "no Hub token: set HF_TOKEN, pass --token, or log in with `hf auth login` "
            "(publishing needs a write token)"
        )
    endpoint = hub_endpoint() or constants.ENDPOINT
    try:
        who = HfApi(endpoint=endpoint, token=token).whoami()
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 429:
            return None
        if status == 401:
            raise HetquantError(
                "the Hub refused the token (401); set HF_TOKEN or pass --token with a valid "
                "write token"
            ) from None
        raise HetquantError(
            f"{endpoint}: checking the token failed: {_first_line(e, token)}"
        ) from None
    except Exception as e:  # network errors of either HTTP stack
        raise HetquantError(
            f"cannot reach the Hub at {endpoint}: {type(e).__name__}: {_first_line(e, token)}"
        ) from None
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HetquantError(
            f"the token of {who.get('name', '?')} is read-only; publishing needs a write token"
        )
    return who.get("name")


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
    for name in files:  # before anything is sent
        inside(artifact, name, f"{artifact}: files to upload")
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
    for name in files:  # checked by upload_artifact: inside the artifact, so inside the stage
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
