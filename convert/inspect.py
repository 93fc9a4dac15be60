"""``hetquant inspect``: what a source checkpoint or an artifact holds, by module group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .manifest import MANIFEST_NAME, precision_table
from .plan import SourceItem, make_plan
from .recipes import Recipe, Target
from .source import SourceCheckpoint
from .verify import load_manifest

__all__ = ["describe", "format_precision"]


class _AsIs(Recipe):
    """Every tensor copied: the precision table of the source itself."""

    def assign(self, role: Any, src_dtype: str) -> Target:
        return Target("copy")


def format_precision(table: dict[str, Any]) -> str:
    """The precision table as aligned text."""
    lines = [f"{'group':<16} {'format':<26} {'params':>16} {'bytes':>16} {'bits/w':>7}"]
    for g in table["groups"]:
        lines.append(
            f"{g['name']:<16} {g['format']:<26} {g['params']:>16,} {g['bytes']:>16,} {g['bits_per_weight']:>7.3f}"
        )
    lines.append(
        f"{'total':<16} {'':<26} {table['params']:>16,} {table['bytes']:>16,} {table['effective_bits_per_weight']:>7.3f}"
    )
    return "\n".join(lines)


def describe(path: Path) -> str:
    if (path / MANIFEST_NAME).exists():
        m = load_manifest(path)
        head = [
            f"artifact   {path}",
            f"recipe     {m['recipe']['name']} {m['recipe']['options'] or ''}".rstrip(),
            f"source     {m['source']['path']} (fingerprint {m['source']['fingerprint'][:12]}, revision {m['source']['revision']})",
            f"files      {len(m['files'])}, {sum(f['size'] for f in m['files'].values()):,} bytes",
            "parts      "
            + ", ".join(f"{k} ({len(v['files'])} files)" for k, v in m["parts"].items()),
        ]
        return "\n".join(head) + "\n\n" + format_precision(m["precision"])
    src = SourceCheckpoint.open(path)
    c = src.config
    items = [SourceItem(t.name, t.role, t.entry.dtype) for t in src.tensors.values()]
    table = precision_table(make_plan(items, _AsIs("as-is", ""), 1 << 62))
    scales = sum(t.scale.nbytes for t in src.tensors.values() if t.scale)
    head = [
        f"checkpoint {path}",
        f"model      {c.raw.get('model_type', '?')}: {c.num_hidden_layers} layers ({c.first_k_dense_replace} dense) "
        f"+ {c.num_nextn_predict_layers} MTP, hidden {c.hidden_size}, {c.n_routed_experts} routed experts",
        f"shards     {len(src.shard_files)}, {src.total_bytes:,} bytes ({scales:,} in FP8 block scales)",
    ]
    return "\n".join(head) + "\n\n" + format_precision(table)
