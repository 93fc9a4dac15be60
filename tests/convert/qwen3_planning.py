"""What a plan says about the artifact it will write, without writing it: every root module's
format, shape and stored tensors (``planned_modules``), and the tensor-parallel sizes the runtime's
layout check allows on them (``tp_sizes``). Used by ``test_layout_qwen3.py`` and by
``benchmarks/dry_run_qwen3.py`` (which loads this file by path)."""

from __future__ import annotations

from typing import Any

from hetquant.convert import Plan
from hetquant.convert.recipes import get_recipe
from hetquant.formats import HetquantError
from hetquant.formats.base import WeightFormat
from hetquant.formats.families import parse_config
from hetquant.formats.safetensors_io import HeaderEntry
from hetquant.runtime import ParallelLayout
from hetquant.runtime.parallel.pieces import ModuleInfo
from hetquant.runtime.parallel.placement import ModelPlacement

__all__ = ["OPTIONS", "TP_SIZES", "planned_modules", "recipe_of", "tp_sizes"]

OPTIONS = {"--group-size": ("group_size", int), "--fp4-layout": ("fp4_layout", str)}
TP_SIZES = (1, 2, 4, 8, 16)


def planned_modules(plan: Plan) -> dict[str, ModuleInfo]:
    """Every root-part module of the planned artifact: format (None: a plain tensor), weight
    shape and stored tensors (header entries without offsets) — what ``open_artifact`` reads
    from the written artifact's manifest and headers."""
    by_module: dict[str, dict[str, Any]] = {}  # module → key → meta
    for f in plan.files:
        for t in f.tensors if f.part == "root" else ():
            module, _, key = t.name.rpartition(".")
            by_module.setdefault(module, {})[key] = t.meta
    out: dict[str, ModuleInfo] = {}
    for job in plan.jobs:
        if job.target.part != "root":
            continue
        for source in job.sources:
            module = source.rpartition(".")[0]
            entries = {k: ("planned", HeaderEntry(f"{module}.{k}", m.dtype, m.shape, 0, 0))
                       for k, m in by_module[module].items()}  # fmt: skip
            fmt = job.target.fmt
            if isinstance(fmt, WeightFormat) and fmt.name != "bf16":
                info = ModuleInfo(module, fmt,
                                  plan.item(source).role.shape, entries)  # fmt: skip
            else:  # kept / copied: one plain tensor per name
                (key,) = entries
                info = ModuleInfo(module, None, entries[key][1].shape, entries)
            out[module] = info
    return out


def tp_sizes(config: dict, modules: dict[str, ModuleInfo]) -> dict[str, Any]:
    """Valid TP sizes (and with attn_dp), and the loader's refusal at TP 8 (None: allowed)."""
    placement = ModelPlacement(parse_config(config), modules)

    def ok(layout: ParallelLayout) -> str | None:
        try:
            placement.check(layout)
        except HetquantError as e:
            return str(e)
        return None

    return {
        "tp": [t for t in TP_SIZES if ok(ParallelLayout(tp_size=t)) is None],
        "tp_attn_dp": [t for t in TP_SIZES if ok(ParallelLayout(tp_size=t, attn_dp=True)) is None],
        "tp8_refusal": ok(ParallelLayout(tp_size=8)),
    }


def recipe_of(recipe: str, extra: list[str]) -> Any:
    opts = {OPTIONS[k][0]: OPTIONS[k][1](v) for k, v in zip(extra[::2], extra[1::2], strict=True)}
    return get_recipe(recipe).with_options(opts) if opts else get_recipe(recipe)
