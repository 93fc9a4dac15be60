"""The model card (README.md) ``hetquant publish`` puts beside an artifact. Pure: no I/O.

Front matter (``front_matter.py``: YAML, emitted without a YAML library so the bytes never
change with a library's version — a re-publish of the same artifact is then a no-op):

    base_model: <repo id>            omitted, with a note in the body, when it is unknown
    base_model_relation: quantized
    license: <id>
    library_name: <transformers | vllm>
    pipeline_tag: text-generation
    tags: [<family>, <model_type>, hetquant, quantized, <recipe>, <Recipe.tags>]

Body: what the artifact is, the recipe, the precision table (manifest["precision"]), the
accuracy table when the manifest has one (manifest["accuracy"]), how to serve it (vllm-ascend,
vLLM, SGLang where the format is one they read; hetquant's loader always) and how to verify it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from ..engine.manifest import format_label
from ..recipes import RECIPES
from .front_matter import (
    CardInputs,
    base_model_from,
    card_metadata,
    license_from_text,
    model_tags,
    parse_front_matter,
    yaml_front_matter,
)

__all__ = [
    "CardInputs",
    "base_model_from",
    "license_from_text",
    "parse_front_matter",
    "render_card",
    "yaml_front_matter",
]


def render_card(inp: CardInputs) -> str:
    """The whole README.md: front matter and body, deterministic for the same inputs."""
    m = inp.manifest
    meta = card_metadata(inp)
    name = inp.repo_id.split("/")[-1]
    src = m.get("source") or {}
    rev = src.get("revision")
    out = [yaml_front_matter(meta), f"# {name}", ""]
    family = (model_tags(inp.config) or ["model"])[0]
    what = f"[{inp.base_model}](https://huggingface.co/{inp.base_model})" if inp.base_model else (
        f"A {family} checkpoint"
    )  # fmt: skip
    at = f" (commit `{rev}`)" if rev and inp.base_model else ""
    out += [
        f"{what}{at} converted by hetquant {m.get('hetquant_version', '?')} "
        f"with the `{inp.recipe}` recipe"
        + (f": {_md(inp.recipe_summary)}." if inp.recipe_summary else "."),
        "",
    ]
    if inp.base_model_note:
        out += [f"> **Base model:** {inp.base_model_note}", ""]
    out += _recipe_section(inp)
    out += _precision_section(m.get("precision"))
    if m.get("accuracy"):
        out += ["## Accuracy", "", *_accuracy_table(m["accuracy"]), ""]
    out += _serving_section(inp)
    out += [
        "## Verify",
        "",
        f"`hetquant.json` lists every file with its size and {m.get('file_digest', 'sha256')} digest; "
        "after downloading, check them:",
        "",
        "```bash",
        f"hf download {inp.repo_id} --local-dir {name}",
        f"hetquant verify {name}",
        "```",
        "",
    ]
    return "\n".join(out)


def _recipe_section(inp: CardInputs) -> list[str]:
    m = inp.manifest
    src = m.get("source") or {}
    opts = m["recipe"].get("options") or {}
    files = m.get("files") or {}
    total = sum(int(f.get("size", 0)) for f in files.values())
    parts = m.get("parts") or {}
    if inp.base_model:
        source = f"`{inp.base_model}`" + (f" at `{src['revision']}`" if src.get("revision") else "")
    else:
        source = "a local checkpoint"
    rows = [
        ("recipe", f"`{inp.recipe}`"),
        ("options", ", ".join(f"`{k}={v}`" for k, v in sorted(opts.items())) or "defaults"),
        ("source", source),
        ("source fingerprint", f"`{src.get('fingerprint', '?')}` (sha256 of index + config)"),
        (
            "files",
            f"{len(files)} files, {_gb(total)} in "
            + ", ".join(f"`{k}` ({len(v.get('files', []))} files)" for k, v in parts.items()),
        ),
        (
            "hetquant",
            f"{m.get('hetquant_version', '?')}, manifest schema {m.get('schema_version')}",
        ),
    ]
    return ["## Recipe", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def _precision_section(table: Mapping[str, Any] | None) -> list[str]:
    if not table:
        return []
    out = [
        "## Precision",
        "",
        "Per module group: storage format, parameters, bytes and bits per weight (scales included).",
        "",
        "| group | format | params | bytes | bits/weight |",
        "|---|---|---:|---:|---:|",
    ]
    for g in table.get("groups", []):
        out.append(
            f"| {_md(g['name'])} | {_md(format_label(g['format']))} | {g['params']:,} | {g['bytes']:,} | "
            f"{g['bits_per_weight']:.3f} |"
        )
    out.append(
        f"| **total** | | {table['params']:,} | {table['bytes']:,} | "
        f"**{table['effective_bits_per_weight']:.3f}** |"
    )
    return [*out, ""]


def _accuracy_table(acc: Any) -> list[str]:
    """A markdown table for the shapes an accuracy record can take; JSON when none fits."""
    if isinstance(acc, Mapping) and isinstance(acc.get("rows"), list):
        head = [f"{_md(k)}: {_cell(v)}" for k, v in acc.items() if k != "rows"]
        return [*(["; ".join(head), ""] if head else []), *_accuracy_table(acc["rows"])]
    if isinstance(acc, Sequence) and not isinstance(acc, str) and acc and all(
        isinstance(r, Mapping) for r in acc
    ):  # fmt: skip
        cols = list(dict.fromkeys(k for r in acc for k in r))
        return _table(cols, [[r.get(c, "") for c in cols] for r in acc])
    if isinstance(acc, Mapping) and acc and all(isinstance(v, Mapping) for v in acc.values()):
        cols = list(dict.fromkeys(k for v in acc.values() for k in v))
        return _table(["", *cols], [[k, *(v.get(c, "") for c in cols)] for k, v in acc.items()])
    if isinstance(acc, Mapping) and acc:
        return _table(["metric", "value"], [[k, v] for k, v in acc.items()])
    return ["```json", json.dumps(acc, indent=2, sort_keys=True), "```"]


def _table(cols: list[Any], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(_md(str(c)) for c in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return out


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.4g}"
    if isinstance(v, (Mapping, list)):
        return _md(json.dumps(v, sort_keys=True))
    return _md(str(v))


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 10**8 else f"{n / 1e6:,.1f} MB"


def _serving_section(inp: CardInputs) -> list[str]:
    repo, recipe = inp.repo_id, inp.recipe
    parts = [p for p in (inp.manifest.get("parts") or {}) if p != "root"]
    out = ["## How to serve", ""]
    if parts:
        names = ", ".join(f"`{PurePosixPath(p)}/`" for p in parts)
        out += [
            f"The root of this repository is an HF model directory **without** the tensors in {names}; "
            "those are loaded by hetquant's runtime (below). Engines that read only the root "
            "directory cannot serve this artifact by themselves.",
            "",
        ]
    elif recipe in RECIPES:  # how engines read the root (``Recipe.serving``)
        out += [line.replace("{repo}", repo) for line in RECIPES[recipe].serving]
    out += [
        "With hetquant's loader, which reads only the bytes each rank keeps and repacks them for "
        "the backend (npu, cuda or cpu):",
        "",
        "```python",
        "from huggingface_hub import snapshot_download",
        "from hetquant.runtime import ParallelLayout, open_artifact",
        "",
        f'art = open_artifact(snapshot_download("{repo}"))',
        'weights = art.load(ParallelLayout(tp_size=2, tp_rank=0), device="npu:0")',
    ]
    if parts:
        out.append("pool = art.cpu_expert_pool(subpools=4)  # routed experts, memory-mapped")
    out += ["```", ""]
    return out
