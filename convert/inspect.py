"""``hetquant inspect``: what a source checkpoint or an artifact holds, by module group."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME, PARTIAL_DIR

from .engine.manifest import format_precision
from .planning.source import PLAIN, SourceCheckpoint
from .verify import artifact_files, count_files, load_manifest

__all__ = ["describe", "source_precision"]


def describe(path: Path) -> str:
    """What ``path`` holds: an artifact (it has ``hetquant.json``) or a source checkpoint."""
    if (path / MANIFEST_NAME).exists():
        return _describe_artifact(path)
    if (path / PARTIAL_DIR).is_dir():
        raise HetquantError(
            f"{path}: no {MANIFEST_NAME}, and {PARTIAL_DIR}/ is there: a hetquant convert into "
            "it did not finish; re-run the same convert command to complete it"
        )
    try:
        return _describe_source(path)
    except HetquantError as e:
        raise HetquantError(
            f"{path}: no {MANIFEST_NAME}, so not a (complete) hetquant artifact; "
            f"nor a source checkpoint: {e}"
        ) from None


def _describe_artifact(path: Path) -> str:
    m = load_manifest(path)
    if "export" in m:
        return _describe_export(path, m)
    src = m["source"]
    files = artifact_files(path, m)
    parts = [f"{k} {len(v['files'])}" for k, v in m["parts"].items()] + [MANIFEST_NAME]
    origin = ", ".join(
        [f"revision {src['revision']}"] * bool(src.get("revision"))
        + [f"fingerprint {src['fingerprint'][:12]}"]
    )
    head = [
        f"artifact   {path}",
        f"recipe     {m['recipe']['name']} {m['recipe']['options'] or ''}".rstrip(),
        f"source     {src.get('repo_id') or src['path']} ({origin})",
        f"files      {count_files(files)} ({', '.join(parts)})",
    ]
    return "\n".join(head) + "\n\n" + format_precision(m["precision"])


def _describe_export(path: Path, m: dict) -> str:
    """An export (``hetquant export``): target, NUMA slices, its source and layers."""
    x, src = m["export"], m["source"]
    layers = [layer["layer"] for layer in x["layers"]]
    return "\n".join([
        f"export     {path}",
        f"layout     {x['to']}, {x['numa']} NUMA slice(s)",
        f"source     {src['path']} (fingerprint {src['fingerprint'][:12]})",
        f"layers     {len(layers)}: {layers}",
        f"files      {count_files(artifact_files(path, m))}",
    ]) + "\n"  # fmt: skip


def _describe_source(path: Path) -> str:
    src = SourceCheckpoint.open(path)
    c = src.config
    scales = sum(t.nbytes - t.main.nbytes for t in src.tensors.values())  # partner tensors
    dense = sum(not c.is_moe_layer(layer) for layer in range(c.num_hidden_layers))
    head = [
        f"checkpoint {path}",
        f"model      {c.raw.get('model_type', '?')}: {c.num_hidden_layers} layers ({dense} dense) "
        f"+ {c.num_mtp_layers} MTP, hidden {c.hidden_size}, {c.num_experts} routed experts",
        f"shards     {len(src.shard_files)}, {src.total_bytes:,} bytes ({scales:,} in scales of quantized weights)",
    ]
    return "\n".join(head) + "\n\n" + format_precision(source_precision(src))


def source_precision(src: SourceCheckpoint) -> dict[str, Any]:
    """The precision table of a source as stored: per group, each tensor's format (its dtype when
    plain), its logical parameters (a packed INT4 weight [n, k/8] I32 counts n·k) and the bytes
    of all its stored parts (scales, shapes, zero points included)."""
    groups: dict[str, dict[str, Any]] = {}
    for t in src.tensors.values():
        key = "mtp" if t.role.mtp else t.role.role.group
        g = groups.setdefault(key, {"name": key, "formats": set(), "params": 0, "bytes": 0})
        g["formats"].add(t.dtype if t.fmt_name == PLAIN else t.fmt_name)
        g["params"] += math.prod(t.role.shape)
        g["bytes"] += t.nbytes
    rows = [
        {"name": g["name"], "format": "+".join(sorted(g.pop("formats"))), **g,
         "bits_per_weight": round(8 * g["bytes"] / g["params"], 4)}
        for g in groups.values()
    ]  # fmt: skip
    params, total = sum(r["params"] for r in rows), sum(r["bytes"] for r in rows)
    return {"groups": rows, "params": params, "bytes": total,
            "effective_bits_per_weight": round(8 * total / params, 4)}  # fmt: skip
