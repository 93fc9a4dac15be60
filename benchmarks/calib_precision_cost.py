"""What float64 calibration costs against float32, on the CPU (issue #25 §0).

Calibration on the CPU computes in float64 so that every CPU gives the same bytes (``calib/awq.py``,
"Reproducibility"). This times the hybrid's calibration (``--calib-data``, and with GPTQ) and
awq-w4a16's on the trained tiny model with ``AwqOptions.dtype`` float64 (the default) and float32,
alternating, ``--repeats`` times each, in one process, and prints the median of each and their
ratio (float64 / float32). ``--threads`` sets torch's intra-op threads.

    python benchmarks/calib_precision_cost.py [--repeats 3] [--samples 16] [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from hetquant.calib.calibrate import AwqOptions, calibrate
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.convert import (
    CALIB_OPTIONS,
    SourceCheckpoint,
    calibration_targets,
    get_recipe,
    plan_for,
)

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "tiny-deepseek-v3-trained"
TEXT = REPO / "examples" / "tiny-tools" / "calib.txt"
CASES = {
    "ascend-hybrid": ("ascend-hybrid", {}),
    "ascend-hybrid --calib-gptq": ("ascend-hybrid", {"calib_gptq": True}),
    "awq-w4a16": ("awq-w4a16", {}),
}


def _run(src, recipe, tokens, dtype: str) -> float:
    plan = plan_for(src, recipe, 5 * 10**9)
    targets, searched = calibration_targets(plan)
    opts = {f: recipe.option(k) for k, f in CALIB_OPTIONS.items() if k in recipe.choices}
    options = dataclasses.replace(AwqOptions(**opts), dtype=dtype)
    t0 = time.perf_counter()
    calibrate(src, tokens, options, targets=targets, searched=searched, device="cpu")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    tokens = token_blocks([TEXT], tok, eos, args.samples, args.seq_len)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "tokens": [args.samples, args.seq_len], "cases": {}}  # fmt: skip
    for label, (name, options) in CASES.items():
        recipe = get_recipe(name).with_options(options) if options else get_recipe(name)
        times: dict[str, list[float]] = {"float64": [], "float32": []}
        _run(src, recipe, tokens, "float32")  # warm-up: kernels, page cache
        for _ in range(args.repeats):
            for dtype in times:
                times[dtype].append(_run(src, recipe, tokens, dtype))
        med = {d: statistics.median(t) for d, t in times.items()}
        report["cases"][label] = {
            "median_s": {d: round(v, 3) for d, v in med.items()},
            "float64_over_float32": round(med["float64"] / med["float32"], 3),
        }
        print(label, json.dumps(report["cases"][label]), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
