"""The one JSON reader for files that come from outside: a source checkpoint or an artifact
(config.json, the index, hetquant.json, a safetensors header, tokenizer_config.json, ...).

Everything loaded is untrusted (DESIGN.md, principles), so a document is bounded before it is
used: at most ``MAX_JSON_BYTES`` bytes (the safetensors library's own header limit) and at most
``MAX_DEPTH`` levels of nested arrays and objects — real files nest 6 at most, and a deeper one
would otherwise end in a ``RecursionError`` wherever the document is parsed, compared or written
back. Every failure is one :class:`HetquantError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .errors import HetquantError
from .safe_paths import open_binary

__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "load_json", "parse_json", "require_json_size"]

MAX_JSON_BYTES = 100 * 1000 * 1000
MAX_DEPTH = 64
_TOO_DEEP = object()


def load_json(path: str | os.PathLike[str], *, limit: int = MAX_JSON_BYTES) -> Any:
    """Read and parse the JSON file ``path`` (bounded: module docstring).

    Raises:
        HetquantError: the file is missing, larger than ``limit`` bytes, not UTF-8 JSON, or
            nested deeper than ``MAX_DEPTH`` levels.
    """
    path = Path(path)
    try:
        with open_binary(path) as f:  # regular files only: a FIFO is refused, not waited on
            require_json_size(path, os.fstat(f.fileno()).st_size, limit)
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise HetquantError(f"{path}: not found") from None
    return parse_json(raw, str(path))


def require_json_size(path: str | os.PathLike[str], size: int, limit: int = MAX_JSON_BYTES) -> None:
    """Refuse a JSON file of ``size`` bytes past ``limit``, before it is read (HetquantError)."""
    if size > limit:
        raise HetquantError(
            f"{path}: {size:,} bytes, more than the {limit:,} a JSON file here may have; "
            "it is not a file hetquant wrote or reads — replace it"
        )


def parse_json(raw: bytes | str, origin: str) -> Any:
    """Parse ``raw`` (the text of ``origin``, named in errors), bounded as ``load_json``."""
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError as e:  # its text quotes a byte of the file: say where instead
        raise HetquantError(
            f"{origin}: invalid JSON (not UTF-8 at byte {e.start}); fix or re-download the file"
        ) from None
    except json.JSONDecodeError as e:  # e.msg and e.pos only: no text of the file
        raise HetquantError(
            f"{origin}: invalid JSON ({e.msg} at byte {e.pos}); fix or re-download the file"
        ) from None
    except ValueError:  # an integer past Python's digit limit: no number hetquant reads
        raise HetquantError(
            f"{origin}: a number too long to read (over {sys.get_int_max_str_digits()} digits); "
            "not a file hetquant wrote or reads — replace it"
        ) from None
    except RecursionError:
        doc = _TOO_DEEP
    if doc is _TOO_DEEP or _depth(raw) > MAX_DEPTH:
        raise HetquantError(
            f"{origin}: JSON nested more than {MAX_DEPTH} levels deep; not a file hetquant "
            "wrote or reads — replace it"
        )
    return doc


# a JSON string: quote, runs of characters other than quote and backslash, escapes, quote
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))  # what bytes.translate deletes
_STEP = np.zeros(256, np.int32)  # byte -> nesting step
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def _depth(raw: bytes | str) -> int:
    """Levels of nested arrays and objects in the valid JSON text ``raw`` (a scalar: 0): the
    deepest running count of its brackets once its strings are gone, by a regex, a translate
    and numpy — walking the parsed tree in Python took 0.25 s of DeepSeek-R1's 163 headers
    (550,000 nodes); this takes 1 ms per 74 kB header."""
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    brackets = _STRING.sub(b"", text).translate(None, _NOT_BRACKET)
    return int(_STEP[np.frombuffer(brackets, np.uint8)].cumsum().max(initial=0))
