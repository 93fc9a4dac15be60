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
from pathlib import Path
from typing import Any

from .errors import HetquantError
from .safe_paths import open_binary

__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "load_json", "parse_json"]

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
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise HetquantError(
                    f"{path}: {size:,} bytes, more than the {limit:,} a JSON file here may have; "
                    "it is not a file hetquant wrote or reads — replace it"
                )
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise HetquantError(f"{path}: not found") from None
    return parse_json(raw, str(path))


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
    except RecursionError:
        doc = _TOO_DEEP
    if doc is _TOO_DEEP or _depth(doc) > MAX_DEPTH:
        raise HetquantError(
            f"{origin}: JSON nested more than {MAX_DEPTH} levels deep; not a file hetquant "
            "wrote or reads — replace it"
        )
    return doc


def _depth(doc: Any) -> int:
    """Levels of nested arrays and objects in ``doc`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            return depth
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
