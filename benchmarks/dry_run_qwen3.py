"""What every recipe makes of Qwen3-235B-A22B and Qwen3-30B-A3B (FP8 and BF16 sources), predicted
by ``--dry-run`` on the real layouts, and which tensor-parallel sizes each artifact loads at.

Writes the real checkpoint layouts (``examples/qwen3-moe-layout/make_layout.py``: every tensor
name/dtype/shape, data as sparse holes) into a temporary directory, then per recipe: runs
``hetquant convert SRC OUT --recipe R --dry-run`` as a subprocess (timed; sizes per artifact part,
bits per weight: ``dry_run_671b.py``'s ``dry_run``), and asks the runtime's layout check which
TP sizes (1, 2, 4, 8, 16) the planned artifact allows (``tests/convert/qwen3_planning.py``, which
``tests/convert/test_layout_qwen3.py`` checks: every root module's format, shape and stored tensors
as the plan writes them; ``ParallelLayout.validate`` on them, without and with attention data
parallelism), with the refusal the loader gives at TP 8.

    python benchmarks/dry_run_qwen3.py
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from hetquant.convert import SourceCheckpoint, plan_for

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "dry_run_qwen3.json"
RECIPES = [("bf16", []), ("ascend-hybrid", []), ("ascend-w8a8", []), ("awq-w4a16", []),
           ("awq-w4a16", ["--group-size", "64"]), ("fp4", []), ("fp4", ["--fp4-layout", "nvfp4"])]  # fmt: skip


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def main() -> None:
    layouts = _load(REPO / "examples/qwen3-moe-layout/make_layout.py", "qwen3_layout")
    bench = _load(REPO / "benchmarks/dry_run_671b.py", "dry_run_671b")
    planning = _load(REPO / "tests/convert/qwen3_planning.py", "qwen3_planning")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in layouts.MODELS:
            for dtype in ("fp8", "bf16"):
                src = layouts.write_layout(Path(tmp) / f"{model}-{dtype}", model, dtype)
                source = SourceCheckpoint.open(src)
                for recipe, extra in RECIPES:
                    row = bench.dry_run(src, Path(tmp) / "out", recipe, extra)
                    plan = plan_for(source, planning.recipe_of(recipe, extra), 5 * 10**9)
                    row |= {"model": model, "source": dtype}
                    row |= planning.tp_sizes(source.config.raw, planning.planned_modules(plan))
                    rows.append(row)
    head = f"{'model':<16} {'src':<4} {'recipe':<28} {'root GB':>8} {'cpu GB':>7} {'bits/w':>7}"
    print(head + f" {'dry-run s':>9}  TP sizes (with attn_dp)")
    for r in rows:
        parts = r["parts"]
        print(
            f"{r['model']:<16} {r['source']:<4} {r['recipe']:<28} "
            f"{parts.get('root', 0) / 1e9:>8.1f} {parts.get('cpu_experts', 0) / 1e9:>7.1f} "
            f"{r['bits_per_weight']:>7.3f} {r['seconds']:>9.1f}  "
            f"{','.join(map(str, r['tp']))} ({','.join(map(str, r['tp_attn_dp']))})"
        )
    bench.write_results(RESULTS, rows)


if __name__ == "__main__":
    main()
