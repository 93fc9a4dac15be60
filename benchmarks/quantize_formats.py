"""Quantize throughput of every registered weight format on one expert-sized FP8 tensor.

The baseline, measured in the same run on the same tensor, is DeepSeek's FP8 → BF16 dequantization
(``fp8_block``). Each format's time covers ``quantize`` of the BF16 weight — the step a recipe adds
on top of the dequantization. Ratios, not seconds, are the result (the machine is noisy); each
figure is the median of ``--repeats`` runs, formats interleaved round-robin.

    python benchmarks/quantize_formats.py [--rows 2048 --cols 7168 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hetquant.formats import FORMATS, get_format

RESULTS = Path(__file__).parent / "results" / "quantize_formats.json"
# Formats that need calibration statistics for quantize, and what a recipe would pass them.
OPTIONS = {"w8a8": {"act_min": -4.0, "act_max": 4.0}}
SKIP = {"fp8_block"}  # the source format itself: it is the baseline's input


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    fp8 = get_format("fp8_block")
    src = fp8.quantize(torch.randn(args.rows, args.cols) / args.cols**0.5)
    w = fp8.dequantize_bf16(src["weight"], src["weight_scale_inv"])  # (rows, cols) bf16

    def baseline() -> object:
        return fp8.dequantize_bf16(src["weight"], src["weight_scale_inv"])

    def quantizer(name: str) -> Callable[[], object]:
        fmt, opts = get_format(name), OPTIONS.get(name, {})
        return lambda: fmt.quantize(w, **opts)

    cases = {"bf16 dequant (baseline)": baseline}
    cases.update({name: quantizer(name) for name in sorted(set(FORMATS) - SKIP)})
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["bf16 dequant (baseline)"])
    rows = []
    print(
        f"[{args.rows}, {args.cols}] FP8 tensor, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'format':<26} {'median s':>9} {'× baseline':>11} {'Mweights/s':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"format": name, "median_s": med, "ratio": med / base})
        print(
            f"{name:<26} {med:>9.4f} {med / base:>11.2f} {args.rows * args.cols / med / 1e6:>11.1f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    meta = {
        "shape": [args.rows, args.cols],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }
    RESULTS.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
