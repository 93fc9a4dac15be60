"""The one reader of ``hetquant.json``: the manifest parsed (bounded, ``json_io``) and its schema
checked before any command or the loader uses a field of it.

A manifest is untrusted like the rest of an artifact, and a wrong-typed or missing field must not
surface as a ``KeyError`` or ``TypeError`` deep inside ``inspect`` or ``run``. The schema below
lists every field hetquant reads, with its type; ``read_manifest`` refuses a manifest that
breaks it with one :class:`HetquantError` naming the field (``recipe.options``,
``files["config.json"].size``). Fields it does not list (``calibration``, ``accuracy``, ...) are
free-form and kept as they are. Two shapes: an artifact's (``convert``: ``recipe``, the source's
dtypes, the precision table) and an export's (``hetquant export``: an ``export`` entry instead).
This module only reads; ``convert/engine/manifest.py`` writes manifests.

Schema 3 names the algorithm of the file digests (``file_digest``, ``formats/file_digests.py``)
and keys every file's digest by it (``{"size", "blake3"}``); schemas 1 and 2 are sha256
(``{"size", "sha256"}``). A manifest naming an algorithm this hetquant does not know is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .errors import HetquantError
from .file_digests import manifest_digest
from .filenames import MANIFEST_NAME, READABLE_SCHEMAS
from .json_io import load_json

__all__ = ["READABLE_SCHEMAS", "check_manifest", "read_manifest"]


@dataclass(frozen=True)
class _Obj:
    """A JSON object with these fields (more are allowed unless ``closed``)."""

    required: dict[str, Any]
    optional: dict[str, Any]
    closed: bool = False


@dataclass(frozen=True)
class _Map:
    """A JSON object of any keys, every value of ``value``'s type."""

    value: Any


@dataclass(frozen=True)
class _List:
    item: Any


_INT, _NUM, _STR, _BOOL, _ANY, _STR_OR_NULL = "int", "num", "str", "bool", "any", "str|null"
_TYPE_WORD = {
    _INT: "a non-negative integer",
    _NUM: "a number",
    _STR: "a string",
    _BOOL: "true or false",
    _STR_OR_NULL: "a string or null",
}
_PARTS = _Map(_Obj({"files": _List(_STR)}, {}))
_COMMON = {"schema_version": _INT, "source": _ANY, "parts": _PARTS}
_OPTIONAL = {"complete": _BOOL, "hetquant_version": _STR, "plan_digest": _STR}
_GROUP = _Obj(
    {"name": _STR, "format": _STR, "params": _INT, "bytes": _INT, "bits_per_weight": _NUM}, {}
)
_PRECISION = {
    "groups": _List(_GROUP),
    "params": _INT,
    "bytes": _INT,
    "effective_bits_per_weight": _NUM,
}
_ARTIFACT = _Obj(
    {
        **_COMMON,
        "recipe": _Obj({"name": _STR, "options": _Map(_ANY)}, {}),
        "source": _Obj(
            {"path": _STR, "fingerprint": _STR, "dtypes": _Map(_STR)},
            {
                "formats": _Map(_STR),
                "format_params": _Map(_Map(_ANY)),
                "revision": _STR_OR_NULL,
                "repo_id": _STR_OR_NULL,
            },
        ),
        "max_shard_size": _INT,
        "precision": _Obj(_PRECISION, {}),
    },
    {
        **_OPTIONAL,
        "module_formats": _Map(
            _Obj({"format": _STR, "shape": _List(_INT)}, {"params": _Map(_ANY)})
        ),
    },
)
_LAYER = _Obj(
    {"layer": _INT, "file": _STR, "prefix": _STR, "fmt": _STR},
    {"params": _Map(_ANY), "num_experts": _INT, "hidden": _INT, "inter": _INT},
    closed=True,
)
_EXPORT = _Obj(
    {
        **_COMMON,
        "source": _Obj({"path": _STR, "fingerprint": _STR}, {}),
        "export": _Obj({"to": _STR, "numa": _INT, "layers": _List(_LAYER)}, {}),
    },
    _OPTIONAL,
)


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """``root/hetquant.json``, parsed and checked against its schema.

    Raises:
        HetquantError: no manifest (not an artifact), invalid or unbounded JSON, an unknown
            ``schema_version``, or a field missing or of the wrong type (named).
    """
    path = Path(root) / MANIFEST_NAME
    if not path.exists():
        raise HetquantError(f"{root}: no {MANIFEST_NAME}; not a (complete) hetquant artifact")
    doc = load_json(path)
    check_manifest(doc, str(path))
    return doc


def check_manifest(doc: Any, origin: str) -> None:
    """Refuse ``doc`` (read from ``origin``) unless it has the manifest schema."""
    if not isinstance(doc, dict):
        raise HetquantError(f"{origin}: not a JSON object; not a hetquant manifest")
    version = doc.get("schema_version")
    if version not in READABLE_SCHEMAS or isinstance(version, bool):
        raise HetquantError(
            f"{origin}: unknown manifest schema {version!r}; this hetquant reads schemas "
            f"{list(READABLE_SCHEMAS)} — use the hetquant version that wrote the artifact"
        )
    problem = _check(doc, _Obj({"file_digest": _STR}, {}), "") if version >= 3 else None
    if problem is None:
        digest = manifest_digest(doc, origin).name  # an unknown algorithm: refused here
        problem = _check(doc, _schema("export" in doc, digest), "")
    if problem is not None:
        field, what = problem
        raise HetquantError(
            f"{origin}: field {field} {what}; the manifest is damaged or was edited — "
            "re-download the artifact or re-run the conversion"
        )


@cache
def _schema(export: bool, digest: str) -> _Obj:
    """An export's or an artifact's schema, its ``files`` entries holding a ``digest`` each."""
    base = _EXPORT if export else _ARTIFACT
    files = _Map(_Obj({"size": _INT, digest: _STR}, {}))
    return _Obj({**base.required, "files": files}, base.optional, base.closed)


def _check(value: Any, spec: Any, field: str) -> tuple[str, str] | None:
    """(field, what is wrong) of the first place ``value`` breaks ``spec``; None if none."""
    if isinstance(spec, _Obj):
        return _check_obj(value, spec, field)
    if isinstance(spec, _Map):
        if not isinstance(value, dict):
            return field, f"must be a JSON object, not {_kind(value)}"
        return _first(_check(v, spec.value, f"{field}[{k!r}]") for k, v in value.items())
    if isinstance(spec, _List):
        if not isinstance(value, list):
            return field, f"must be a list, not {_kind(value)}"
        return _first(_check(v, spec.item, f"{field}[{i}]") for i, v in enumerate(value))
    return (
        None
        if _scalar_ok(value, spec)
        else (field, f"must be {_TYPE_WORD[spec]}, not {_kind(value)}")
    )


def _check_obj(value: Any, spec: _Obj, field: str) -> tuple[str, str] | None:
    if not isinstance(value, dict):
        return field or "(top level)", f"must be a JSON object, not {_kind(value)}"
    dot = f"{field}." if field else ""
    for key in spec.required:
        if key not in value:
            return f"{dot}{key}", "is missing"
    if spec.closed and (
        extra := sorted(value.keys() - spec.required.keys() - spec.optional.keys())
    ):
        return f"{dot}{extra[0]}", "is not a field of this entry"
    fields = {**spec.optional, **spec.required}
    return _first(_check(value[k], s, f"{dot}{k}") for k, s in fields.items() if k in value)


def _scalar_ok(value: Any, spec: str) -> bool:
    if spec == _ANY:
        return True
    if spec == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if spec == _INT:
        return isinstance(value, int) and value >= 0
    if spec == _NUM:
        return isinstance(value, (int, float))
    return isinstance(value, str) or (spec == _STR_OR_NULL and value is None)


def _first(problems: Any) -> tuple[str, str] | None:
    return next((p for p in problems if p is not None), None)


def _kind(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)  # null, true, -3, 1.5
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a value")
