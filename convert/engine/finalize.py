"""The end of a convert: the artifact completed in the work directory, then moved into OUTPUT.

``build`` fsyncs the containers (unless hashed and fsynced already while the jobs ran), writes the
index, config.json, the recipe's extra JSON files and the source's small non-weight files
(tokenizers, chat templates, remote code, licences) beside them, checks that the source did not
change, hashes every
file and writes the manifest — all inside ``OUTPUT/.hetquant-partial/``, so a previous artifact
in OUTPUT stays whole and valid while this happens (``--overwrite``). ``move_in``
(``move.py``) then replaces it: the old manifest goes first (OUTPUT stops claiming to be
an artifact), the new files are renamed in, files of the old artifact that the new one lacks are
removed (files hetquant did not write are kept), and the new manifest comes last. A kill during
``move_in`` leaves the complete new artifact split between the work directory and OUTPUT;
re-running the same command finishes the move.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetquant.formats import get_format
from hetquant.formats.filenames import INDEX_NAME, MANIFEST_NAME

from ..fs.os_errors import naming
from ..fs.source_guard import SourceGuard
from ..planning.aux_files import AuxFiles, aux_files
from ..planning.plan import Plan, SourceItem
from ..planning.roles import PLAIN
from ..planning.source import SourceCheckpoint
from ..recipes import ROOT
from ..recipes.metadata import artifact_metadata
from .manifest import build_manifest, digest_files, write_json_atomic
from .move import move_in

__all__ = [
    "ARTIFACT_CARD",
    "artifact_names",
    "build",
    "carried_files",
    "metadata_docs",
    "move_in",
    "source_variants",
]

ARTIFACT_CARD = "README.md"  # the artifact's model card: ``hetquant publish`` writes its own
log = logging.getLogger("hetquant.convert")


def metadata_docs(plan: Plan, source: SourceCheckpoint) -> dict[str, Any]:
    """File name → JSON document of the artifact's index, config.json and extra files."""
    root_files = [f for f in plan.files if f.part == ROOT]
    index = {
        "metadata": {"total_size": sum(f.data_size for f in root_files)},
        "weight_map": {t.name: f.name for f in root_files for t in f.tensors},
    }
    config, extra = artifact_metadata(plan, source.config.raw)
    return {INDEX_NAME: index, "config.json": config, **dict(sorted(extra.items()))}


def json_size(doc: Any) -> int:
    """Bytes ``write_json_atomic`` writes for ``doc``."""
    return len(json.dumps(doc, indent=2, sort_keys=False).encode()) + 1


def carried_files(plan: Plan, source: SourceCheckpoint) -> AuxFiles:
    """The source's small non-weight files the artifact carries (``convert/planning/aux_files.py``).

    Never one of the artifact's own names: its containers, index, config.json, the recipe's
    description files, the manifest, and README.md (the source's card describes the source;
    ``hetquant publish`` generates the artifact's).
    """
    reserved = {f.name for f in plan.files} | set(metadata_docs(plan, source))
    return aux_files(source.root, reserved=reserved | {MANIFEST_NAME, ARTIFACT_CARD})


def artifact_names(plan: Plan, source: SourceCheckpoint) -> dict[str, Path | None]:
    """Every file the artifact of ``plan`` will have but its manifest → the source file it is a
    copy of (None: the convert writes it)."""
    names: dict[str, Path | None] = {f.name: None for f in plan.files}
    names |= dict.fromkeys(metadata_docs(plan, source))
    return names | {n: source.root / n for n in carried_files(plan, source).names}


def build(
    source: SourceCheckpoint, plan: Plan, work: Path, digest: str,
    calibration: dict[str, Any] | None, guard: SourceGuard,
    digests: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Complete the artifact inside ``work`` (see module docstring); returns its manifest.

    ``digests``: the containers' size and sha256, already hashed and fsynced while the jobs ran
    (``hashing.FileHashes``); without them the containers are fsynced and hashed here."""
    digests = dict(digests or {})
    for f in plan.files:
        if f.name not in digests:
            with naming(work / f.name), open(work / f.name, "rb+") as fh:
                os.fsync(fh.fileno())
    docs = metadata_docs(plan, source)
    for name, doc in docs.items():
        write_json_atomic(work / name, doc)
    carried = carried_files(plan, source)
    for name, why in carried.skipped.items():
        log.warning("%s of the source is not carried into the artifact: %s", name, why)
    aux = carried.names
    for n in aux:
        tmp = work / f".{n}.tmp"
        with naming(tmp):  # a write's EFBIG, ENOSPC: no path
            shutil.copyfile(source.root / n, tmp)
        os.replace(tmp, work / n)
    guard.check()  # the last moment a changed source can still be refused
    names = [f.name for f in plan.files] + [*docs, *aux]
    parts: dict[str, list[str]] = {}
    for f in plan.files:
        parts.setdefault(f.part, []).append(f.name)
    parts[ROOT] += [*docs, *aux]
    src_doc = {
        "path": str(source.root),
        "fingerprint": source.fingerprint,
        "revision": source.revision,
        "repo_id": source.repo_id,
        "bytes": source.total_bytes,
        "dtypes": {i.role.role.name: i.dtype for i in plan.items},
        "formats": {i.role.role.name: i.fmt for i in plan.items},
    }
    if variants := source_variants(plan.items):  # what verify needs to replay the plan
        src_doc["format_params"] = variants
    rest = digest_files({n: work / n for n in names if n not in digests})  # docs, aux files
    files = {n: digests[n] if n in digests else rest[n] for n in names}
    manifest = build_manifest(plan, src_doc, files, parts, digest)
    if calibration is not None:
        manifest["calibration"] = calibration
    write_json_atomic(work / MANIFEST_NAME, manifest)
    return manifest


def source_variants(items: Sequence[SourceItem]) -> dict[str, dict[str, Any]]:
    """Per role, the source format's parameters that differ from its defaults (K2 Thinking's
    ``ct_pack_quantized`` group 32, not 128): what the manifest's ``source.formats`` names alone
    would not tell ``verify``'s replay. Empty for a source of default variants."""
    out: dict[str, dict[str, Any]] = {}
    defaults: dict[str, dict[str, Any]] = {}  # format name → its default variant's params
    for item in items:
        if item.fmt == PLAIN or not item.params:
            continue
        if item.fmt not in defaults:
            defaults[item.fmt] = get_format(item.fmt).params
        default = defaults[item.fmt]
        if diff := {k: v for k, v in item.params if default.get(k) != v}:
            out[item.role.role.name] = diff
    return out
