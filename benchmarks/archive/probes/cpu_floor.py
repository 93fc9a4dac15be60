"""Issue 30, eleventh round: the least time a conversion onto tmpfs can take on this host, from
what its parts cost when each runs alone on every core — set against the limit and the wall that
``bench_convert_limit.py`` measured.

A conversion must (1) run its recipe's kernels over the source, (2) hash every output byte
(BLAKE3 tree digests: the manifest) and (3) have the output's tmpfs pages made, all on the same
cores. ``kernel_scaling.py`` times each alone at P processes (the recipe's expert kernel over the
whole source; BLAKE3 a block row at a time; pages ``MADV_POPULATE_WRITE``-d a block row at a
time). The floor is their CPU seconds at P processes over P cores, plus the run's own start-up
(serial). It leaves out Python, reading the source's maps, page-cache locks and the workers'
exit, so a conversion cannot beat it; where floor / limit is above 1.25, the target "wall within
1.25 of the limit" cannot be met on that host with these kernels.

    python benchmarks/archive/probes/cpu_floor.py KERNEL_SCALING.json BENCH_CONVERT_LIMIT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KERNEL = {  # recipe -> the kernel_scaling kind that does most of its source
    "bf16": "fp8",
    "ascend-hybrid": "int4",
    "ascend-w8a8": "w8a8",
    "awq-w4a16": "awq",
    "fp4": "fp4",
}


def rates(scaling: dict, procs: int) -> dict[str, float]:
    """Per-process bytes per second of each kind at ``procs`` processes."""
    got = {r["kind"]: r["per_proc_gbps"] * 1e9 for r in scaling["runs"] if r["procs"] == procs}
    missing = {"hash", "pages", *KERNEL.values()} - set(got)
    if missing:
        raise SystemExit(
            f"cpu_floor: no {sorted(missing)} at {procs} processes in the scaling JSON"
        )
    return got


def floor(run: dict, rate: dict[str, float]) -> dict[str, float]:
    """CPU seconds of each part, and the floor wall, for one ``bench_convert_limit`` run."""
    src, out, p = run["source_bytes"], run["output_bytes"], run["workers"]
    cpu = {
        "kernels": src / rate[KERNEL[run["recipe"]]],
        "hash": out / rate["hash"],
        "pages": out / rate["pages"],
    }
    start = run["phases"]["startup_s"]
    wall = sum(cpu.values()) / p + start
    return {**{f"{k}_cpu_s": v for k, v in cpu.items()}, "startup_s": start, "floor_s": wall,
            "floor_over_limit": wall / run["limit_s"], "wall_over_limit": run["wall_over_limit"],
            "cpu_s": run["cpu_s"], "floor_cpu_s": sum(cpu.values())}  # fmt: skip


def main() -> None:
    scaling, limit = (json.loads(Path(a).read_text()) for a in sys.argv[1:3])
    print(f"{'recipe':14s} {'kernels':>8s} {'hash':>6s} {'pages':>6s}  {'floor':>6s} {'limit':>6s}"
          f" {'floor/lim':>9s} {'wall/lim':>8s}  CPU-s: run / floor")  # fmt: skip
    for run in limit["runs"]:
        f = floor(run, rates(scaling, run["workers"]))
        print(f"{run['recipe']:14s} {f['kernels_cpu_s']:8.1f} {f['hash_cpu_s']:6.1f} {f['pages_cpu_s']:6.1f}"
              f"  {f['floor_s']:5.2f}s {run['limit_s']:5.2f}s {f['floor_over_limit']:9.2f}"
              f" {f['wall_over_limit']:8.2f}  {f['cpu_s']:.1f} / {f['floor_cpu_s']:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
