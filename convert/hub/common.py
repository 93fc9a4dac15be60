"""What every Hub call of hetquant shares: the environment read at call time, and redaction.

The token is passed through to huggingface_hub and never printed, logged or put in a message.
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read when a function runs (huggingface_hub reads them
once, at import), so setting them later in the same process still takes effect.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import quote

__all__ = ["hub_endpoint", "hub_offline", "redact"]


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
    """``text`` with ``token`` (and anything shaped like an HF token) replaced by ``***``.

    The token is replaced in every form a message may quote it in (:func:`_token_forms`): an
    HTTP stack that refuses ``"secret\\r"`` as a header value shows it escaped, as
    ``b'Bearer secret\\\\r'``, which the raw value does not match.
    """
    for form in _token_forms(token):
        text = text.replace(form, "***")
    return re.sub(r"hf_[A-Za-z0-9]{20,}", "hf_***", text)


def _token_forms(token: str | None) -> list[str]:
    """``token`` as given and without surrounding whitespace, each raw, escaped as ``repr``,
    JSON, a bytes ``repr`` and a URL quote it; longest first (a form may contain another)."""
    if not token:
        return []
    forms: set[str] = set()
    for value in {token, token.strip()} - {""}:
        forms |= {
            value,
            repr(value)[1:-1],
            json.dumps(value)[1:-1],
            json.dumps(value, ensure_ascii=False)[1:-1],
            repr(value.encode("utf-8", "backslashreplace"))[2:-1],
            quote(value, safe=""),
        }
    return sorted(forms - {""}, key=len, reverse=True)


def _first_line(e: BaseException, token: str | None) -> str:
    lines = str(e).strip().splitlines()
    return redact(lines[0] if lines else type(e).__name__, token)
