"""fp4's quantizer jobs against awq-w4a16's on the same source, measured in the same run.

The figure of issue 30: the convert's jobs phase (``timings`` ``jobs_s``: every job of the plan,
from the first read of the source to the last byte written, hashing running beside it) of
``fp4`` (Ascend tiled layout, the default), ``fp4 --fp4-layout nvfp4`` and ``awq-w4a16`` (RTN),
in-process (``--workers 1``: one core, what a pool worker does) or with a pool, rounds
interleaved after one warm-up round (kernel build, ``import torch``), medians reported.

    python benchmarks/bench_fp4_jobs.py --source /dev/shm/hq_prof --work /dev/shm/hqf --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import machine_info, median, warm_page_cache, write_result
from make_synthetic import is_current, write_checkpoint

from hetquant.convert import SourceCheckpoint, convert, get_recipe

RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "awq-w4a16": ("awq-w4a16", {}),
    "fp4": ("fp4", {}),
    "fp4 nvfp4 layout": ("fp4", {"fp4_layout": "nvfp4"}),
}


class _Timings(logging.Handler):
    """Keeps the engine's last ``timings`` debug line (convert/engine/convert.py)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "timings %s":
            self.last = json.loads(record.args[0])  # type: ignore[index]


def jobs_seconds(src: SourceCheckpoint, out: Path, name: str, workers: int, t: _Timings) -> float:
    recipe, options = RECIPES[name]
    shutil.rmtree(out, ignore_errors=True)
    convert(src, out, get_recipe(recipe).with_options(options), max_shard_size=5 * 10**9,
            workers=workers)  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return float(t.last["jobs_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=Path("/dev/shm/hetquant-fp4-src"))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/hetquant-fp4-out"))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not is_current(args.source, args.experts, 1024, 0, dense_layers=0):
        write_checkpoint(args.source, args.experts, dense_layers=0)
    src = SourceCheckpoint.open(args.source)
    warm_page_cache(sorted(args.source.glob("*.safetensors")))
    t = _Timings()
    log = logging.getLogger("hetquant.convert")
    log.addHandler(t)
    log.setLevel(logging.DEBUG)
    for name in RECIPES:  # warm-up: kernels built, torch imported
        jobs_seconds(src, args.work, name, args.workers, t)
    times: dict[str, list[float]] = {name: [] for name in RECIPES}
    for _ in range(args.rounds):
        for name in RECIPES:
            times[name].append(jobs_seconds(src, args.work, name, args.workers, t))
    awq = median(times["awq-w4a16"])
    rows = {n: {"jobs_s": ts, "median_s": median(ts), "vs_awq": median(ts) / awq} for n, ts in times.items()}  # fmt: skip
    print(f"{src.total_bytes / 1e9:.2f} GB source, --workers {args.workers}, {args.rounds} rounds")
    for name, r in rows.items():
        print(f"{name:<18} jobs {r['median_s']:7.2f} s  {r['vs_awq']:5.2f}× awq-w4a16")
    if args.json:
        doc = {"benchmark": "bench_fp4_jobs", "machine": machine_info(), "workers": args.workers,
               "source_bytes": src.total_bytes, "rows": rows}  # fmt: skip
        write_result(args.json, doc)


if __name__ == "__main__":
    main()
