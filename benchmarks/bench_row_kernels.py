"""The native quantize kernels side by side, per instruction path, on one expert-shaped weight.

The converter's hot loops (``formats/_rows_native.cpp``, ``formats/_quant_native.cpp``) on BF16
rows [``--rows``, ``--cols``] (default DeepSeek's gate/up [2048, 7168]), each at every instruction
path this CPU has (3 AVX-512, 2 AVX2, 1 generic C++): W8A8 per-row int8 (``ascend-w8a8``'s
experts), INT4 per-row (``ascend-hybrid``'s CPU experts), AWQ RTN group 128 (``awq-w4a16``) and
NVFP4 into each layout (``fp4``: ``tiled`` is the Ascend one). The baseline, measured in the same
run, is the INT4 kernel at the same path for W8A8 (issue 30: W8A8's per-weight work is no more
than INT4's) and AWQ for NVFP4 (fp4 at awq-w4a16's speed, ≤ 1.3). Best of ``--repeats``
(interleaved), single thread.

    python benchmarks/bench_row_kernels.py [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import machine_info, write_result  # noqa: E402

from hetquant.formats import _quant_native as qn  # noqa: E402
from hetquant.formats import _rows_native as rn  # noqa: E402

RESULT = HERE / "results" / "bench_row_kernels.json"
LAYOUTS = ("rows", "kmajor", "tiled")


def kernels(w: np.ndarray, isa: int) -> dict[str, Callable[[], Any]]:
    """Name → one call of that kernel on ``w`` (BF16 bits [rows, cols]) at path ``isa``."""
    calls: dict[str, Callable[[], Any]] = {
        "w8a8_rows": lambda: rn.w8a8_rows_array(w, isa=isa),
        "int4_rows": lambda: rn.int4_rows_array(w, isa=isa),
        "awq_rtn_g128": lambda: qn.awq_rtn_array(w, 128, isa=isa),
    }
    for layout in LAYOUTS:
        calls[f"nvfp4_{layout}"] = lambda lay=layout: qn.nvfp4_array(w, 1e-3, lay, isa=isa)
    return calls


def measure(w: np.ndarray, repeats: int) -> dict[int, dict[str, float]]:
    """Best seconds per kernel per path, the kernels interleaved within each repeat."""
    calls = {isa: kernels(w, isa) for isa in range(qn.best_isa(), 0, -1)}
    for isa, named in calls.items():  # once untimed: each kernel takes the weight, and is warm
        for name, call in named.items():
            if call() is None:
                raise SystemExit(f"{name} at path {isa} declined the weight")
    best: dict[int, dict[str, float]] = {isa: {} for isa in calls}
    for _ in range(repeats):
        for isa, named in calls.items():
            for name, call in named.items():
                t0 = time.perf_counter()
                call()
                dt = time.perf_counter() - t0
                best[isa][name] = min(best[isa].get(name, dt), dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=RESULT)
    args = ap.parse_args()
    if not qn.available():
        raise SystemExit("no native kernels here (no C++ compiler?)")
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((args.rows, args.cols), dtype=np.float32) * 0.02
    w = (w32.view(np.uint32) >> 16).astype(np.uint16)  # [rows, cols] BF16 bits (truncated)
    best = measure(w, args.repeats)
    rows = []
    for isa, t in best.items():
        row = {"isa": isa, **{k: round(v * 1e3, 3) for k, v in t.items()}}
        row["w8a8_over_int4"] = t["w8a8_rows"] / t["int4_rows"]
        row["nvfp4_tiled_over_awq"] = t["nvfp4_tiled"] / t["awq_rtn_g128"]
        rows.append(row)
        ms = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items())
        print(f"path {isa}: {ms} ms | w8a8/int4 {row['w8a8_over_int4']:.2f}"
              f"  nvfp4 tiled/awq {row['nvfp4_tiled_over_awq']:.2f}")  # fmt: skip
    doc = {"benchmark": "bench_row_kernels", "machine": machine_info(), "shape": [args.rows, args.cols],
           "unit": "ms, best of repeats, one thread", "paths": rows}  # fmt: skip
    write_result(args.json, doc)


if __name__ == "__main__":
    main()
