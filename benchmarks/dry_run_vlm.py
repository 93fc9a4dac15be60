"""What every recipe makes of Qwen3-VL-235B-A22B, Qwen3-VL-30B-A3B (BF16 fused experts; FP8 per
expert) and Kimi K2.5 (INT4 experts), predicted by ``--dry-run`` on their real layouts
(``examples/vlm-layout/make_layout.py``), with the tensor-parallel sizes each planned artifact
loads at (``tests/convert/qwen3_planning.py``'s ``tp_sizes`` on ``planned_modules``).

A recipe the source refuses (K2.5's INT4 experts re-quantized without ``--requantize``) is
recorded with its error line, as ``dry_run_families.py`` does.

    PATH=.venv/bin:$PATH python benchmarks/dry_run_vlm.py [MODEL ...]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

from hetquant.convert import Plan, SourceCheckpoint, plan_for
from hetquant.formats import HetquantError
from hetquant.runtime.parallel.pieces import ModuleInfo

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "dry_run_vlm.json"
RECIPES = [("bf16", []), ("ascend-hybrid", []), ("ascend-w8a8", []), ("ascend-w4a8", []),
           ("ascend-w4a16", []), ("awq-w4a16", []), ("ct-w4a16", []), ("fp4", [])]  # fmt: skip


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


_BESIDE = (
    "bias",
    "e_score_correction_bias",
)  # plain tensors a kept module stores beside its weight


def planned_modules(qwen3: Any, plan: Plan) -> dict[str, ModuleInfo]:
    """``qwen3_planning.planned_modules``, where a kept module may store a bias beside its weight
    (the vision tower's linears and LayerNorms, DeepSeek's router): its shape is its weight's."""
    import dataclasses

    from hetquant.formats.safetensors_io import HeaderEntry

    keep = {}
    for f in plan.files:
        for t in f.tensors if f.part == "root" else ():
            module, _, key = t.name.rpartition(".")
            if key in _BESIDE:
                keep.setdefault(module, {})[key] = t
    trimmed = dataclasses.replace(plan, files=[
        dataclasses.replace(f, tensors=[t for t in f.tensors if t.name.rpartition(".")[0] not in keep
                                        or t.name.rpartition(".")[2] not in _BESIDE]) for f in plan.files])  # fmt: skip
    out = qwen3.planned_modules(trimmed)
    for module, parts in keep.items():
        if module in out:
            entries = dict(out[module].entries)
            for key, t in parts.items():
                entries[key] = ("planned", HeaderEntry(t.name, t.meta.dtype, t.meta.shape, 0, 0))
            out[module] = dataclasses.replace(out[module], entries=entries)
    return out


def main() -> None:
    layouts = _load(REPO / "examples/vlm-layout/make_layout.py", "vlm_layout")
    bench = _load(REPO / "benchmarks/dry_run_671b.py", "dry_run_671b")
    qwen3 = _load(REPO / "tests/convert/qwen3_planning.py", "qwen3_planning")
    rows = []
    only = set(sys.argv[1:])  # model names to run (default: all)
    with tempfile.TemporaryDirectory() as tmp:
        for model, dtypes in layouts.MODELS.items():
            if only and model not in only:
                continue
            for dtype in dtypes:
                src = layouts.write_layout(Path(tmp) / f"{model}-{dtype}", model, dtype)
                source = SourceCheckpoint.open(src)
                for recipe, extra in RECIPES:
                    row = bench.dry_run(src, Path(tmp) / "out", recipe, extra)
                    row |= {"model": model, "source": dtype}
                    if "refused" not in row:
                        try:
                            plan = plan_for(source, qwen3.recipe_of(recipe, extra), 5 * 10**9)
                        except HetquantError as e:  # pragma: no cover - the dry run said yes
                            row["plan_error"] = str(e)
                        else:
                            row |= qwen3.tp_sizes(source.config.raw, planned_modules(qwen3, plan))
                    rows.append(row)
                    print(row, flush=True)
                    bench.write_results(RESULTS.with_suffix(".partial.json"), rows)
    print(f"{'model':<20} {'src':<5} {'recipe':<14} {'root GB':>8} {'cpu GB':>7} {'bits/w':>7} "
          f"{'dry-run s':>9}  TP sizes (with attn_dp)")  # fmt: skip
    for r in rows:
        head = f"{r['model']:<20} {r['source']:<5} {r['recipe']:<14}"
        if "refused" in r:
            print(f"{head} refused: {r['refused'].splitlines()[-1][:110]}")
            continue
        parts = r["parts"]
        print(
            f"{head} {parts.get('root', 0) / 1e9:>8.1f} {parts.get('cpu_experts', 0) / 1e9:>7.1f} "
            f"{r['bits_per_weight']:>7.3f} {r['seconds']:>9.1f}  "
            f"{','.join(map(str, r.get('tp', [])))} ({','.join(map(str, r.get('tp_attn_dp', [])))})"
        )
    bench.write_results(RESULTS, rows)


if __name__ == "__main__":
    main()
