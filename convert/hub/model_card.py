"""The model card (README.md) ``hetquant publish`` puts beside an artifact. Pure: no I/O.

Front matter (YAML, emitted here without a YAML library so the bytes never change with a
library's version — a re-publish of the same artifact is then a no-op):

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
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.families import family_for_config

from ..engine.manifest import format_label
from ..recipes import RECIPES

__all__ = [
    "CardInputs",
    "base_model_from",
    "license_from_text",
    "parse_front_matter",
    "render_card",
    "yaml_front_matter",
]

PIPELINE_TAG = "text-generation"
REQUIRED_KEYS = ("license", "library_name", "pipeline_tag", "tags")

_KNOWN_LICENSES = (  # repo id prefix → license of its model card, when the card can't be read
    ("deepseek-ai/DeepSeek-V3", "mit"),
    ("deepseek-ai/DeepSeek-R1", "mit"),
)
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}
_HF_CACHE_PATH = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[0-9a-f]{40}/?$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class CardInputs:
    """Everything the card says, gathered by the caller (files, options) before rendering."""

    def __init__(
        self,
        manifest: Mapping[str, Any],
        repo_id: str,
        *,
        license: str,
        base_model: str | None,
        base_model_note: str | None = None,
        config: Mapping[str, Any] | None = None,
        recipe_summary: str | None = None,
    ) -> None:
        self.manifest = manifest
        self.repo_id = repo_id
        self.license = license
        self.base_model = base_model
        self.base_model_note = base_model_note
        self.config = config or {}
        self.recipe_summary = recipe_summary

    @property
    def recipe(self) -> str:
        return str(self.manifest["recipe"]["name"])


# what the card is built from -----------------------------------------------------------------------
def base_model_from(
    manifest: Mapping[str, Any], config: Mapping[str, Any] | None
) -> tuple[str | None, str | None]:
    """``(repo id, None)`` of the source model, or ``(None, why not)``.

    In order: the repo id recorded in the manifest (a Hub SOURCE); the repo an HF-cache snapshot
    path belongs to; config.json's ``_name_or_path`` when it is a repo id.
    """
    src = manifest.get("source") or {}
    repo = src.get("repo_id")
    if isinstance(repo, str) and _REPO_ID.match(repo):
        return repo, None
    m = _HF_CACHE_PATH.search(str(src.get("path") or "").replace("\\", "/"))
    if m:
        return f"{m[1]}/{m[2]}", None
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and _REPO_ID.match(name) and not name.startswith((".", "/")):
        return name, None
    return None, (
        "The source was a local directory whose config.json names no Hub repository, so the "
        "card names no base model; pass `--base-model org/name` to `hetquant publish` to set it."
    )


def parse_front_matter(text: str) -> dict[str, Any]:
    """The YAML front matter of a model card as a dict (empty when absent or unreadable)."""
    if not text.startswith("---"):
        return {}
    try:
        import yaml  # huggingface_hub depends on PyYAML

        end = text.index("\n---", 3)
        doc = yaml.safe_load(text[3:end])
    except Exception:
        return {}
    return doc if isinstance(doc, dict) else {}


def license_from_text(
    card_text: str | None, license_text: str | None, base_model: str | None
) -> str | None:
    """The license id: the source card's ``license:``, else a recognised LICENSE file, else what
    the base model's card is known to say (DeepSeek-V3 / R1: mit)."""
    if card_text:
        lic = parse_front_matter(card_text).get("license")
        if isinstance(lic, str) and lic.strip():
            return lic.strip()
    if license_text:
        head = license_text.lstrip()[:200].lower()
        if head.startswith("mit license") or "permission is hereby granted, free of charge" in (
            license_text.lower()
        ):
            return "mit"
        if "apache license" in head and "version 2.0" in license_text[:400].lower():
            return "apache-2.0"
    for prefix, lic in _KNOWN_LICENSES:
        if base_model and base_model.startswith(prefix):
            return lic
    return None


# rendering ----------------------------------------------------------------------------------------
def card_metadata(inp: CardInputs) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if inp.base_model:
        meta["base_model"] = inp.base_model
        meta["base_model_relation"] = "quantized"
    meta["license"] = inp.license
    recipe = RECIPES.get(inp.recipe)  # None: a recipe this hetquant does not know
    meta["library_name"] = recipe.library if recipe else "vllm"
    meta["pipeline_tag"] = PIPELINE_TAG
    tags = _model_tags(inp.config)
    tags += ["hetquant", "quantized", inp.recipe, *(recipe.tags if recipe else ())]
    meta["tags"] = list(dict.fromkeys(tags))
    return meta


def _model_tags(config: Mapping[str, Any]) -> list[str]:
    """The model family's name and config.json's ``model_type`` (Kimi K2: ``deepseek_v3``,
    ``kimi_k2``); just the model type when no registered family claims it."""
    model_type = config.get("model_type")
    tags = [model_type] if isinstance(model_type, str) and model_type else []
    try:
        return list(dict.fromkeys([family_for_config(config).name, *tags]))
    except HetquantError:
        return tags


def yaml_front_matter(meta: Mapping[str, Any]) -> str:
    """``---\\n…\\n---\\n`` for a mapping of strings and lists of strings."""
    lines = ["---"]
    for key, value in meta.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}:")
            lines += [f"- {_scalar(v)}" for v in value]
        else:
            lines.append(f"{key}: {_scalar(value)}")
    lines.append("---")
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    s = str(value)
    if _PLAIN.match(s) and s.lower() not in _YAML_WORDS and not _looks_numeric(s):
        return s
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def render_card(inp: CardInputs) -> str:
    """The whole README.md: front matter and body, deterministic for the same inputs."""
    m = inp.manifest
    meta = card_metadata(inp)
    name = inp.repo_id.split("/")[-1]
    src = m.get("source") or {}
    rev = src.get("revision")
    out = [yaml_front_matter(meta), f"# {name}", ""]
    family = (_model_tags(inp.config) or ["model"])[0]
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
