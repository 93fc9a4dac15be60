"""The Hugging Face Hub side of hetquant: fetching a source, checking and uploading an artifact.

This module is the public face; the code lives by responsibility in:

- :mod:`.source`: ``resolve_source("org/name@rev", download_dir, token)``, a ``SOURCE``
  argument → local checkpoint directory and commit sha (only the files a conversion reads).
- :mod:`.limits`: ``check_hub_limits``, the Hub's limits applied before anything is sent.
- :mod:`.upload`: ``check_credentials`` (the token, before anything else), and
  ``upload_artifact``, a resumable upload that makes no commit when nothing
  changed.
- :mod:`.common`: ``HF_ENDPOINT``/``HF_HUB_OFFLINE`` read at call time, token redaction.
- :mod:`.model_card`: the README.md ``hetquant publish`` puts beside an artifact (pure).

The token is passed through to huggingface_hub and never printed, logged or put in a message.
"""

from __future__ import annotations

from .common import hub_endpoint, hub_offline, redact
from .limits import (
    FOLDER_ENTRIES_MAX,
    HARD_FILE_BYTES,
    PRIVATE_FREE_BYTES,
    RECOMMENDED_FILE_BYTES,
    REPO_FILES_RECOMMENDED,
    LimitReport,
    check_hub_limits,
)
from .source import SOURCE_META_IGNORE, parse_repo_spec, resolve_source
from .upload import UploadResult, check_credentials, upload_artifact

__all__ = [
    "FOLDER_ENTRIES_MAX",
    "HARD_FILE_BYTES",
    "PRIVATE_FREE_BYTES",
    "RECOMMENDED_FILE_BYTES",
    "REPO_FILES_RECOMMENDED",
    "SOURCE_META_IGNORE",
    "LimitReport",
    "UploadResult",
    "check_credentials",
    "check_hub_limits",
    "hub_endpoint",
    "hub_offline",
    "parse_repo_spec",
    "redact",
    "resolve_source",
    "upload_artifact",
]
