"""Issue 30, eighth round: two trees' ``hetquant convert`` into /dev/shm, interleaved (the host A/B
of workers hashing what they wrote, 5ef38b0, against the parent's threads reading it back).

Needs each tree's packages linked under ``DIR/hetquant`` (formats, convert, calib, runtime) and
the blake3 wheel on the path. Per run: wall, and the convert's children's CPU; ``--split``: the
parent's own CPU against its workers' (``getrusage`` at the parent's exit) and the
``/proc/vmstat`` counters that moved by more than 20,000.

    python hash_in_worker_ab.py SRC --trees old=/tmp/hqo new=/tmp/hq --recipes bf16 fp4 \
        --rounds 3 --workers 16 [--split]

Output of the run on the lent host: ``archive/results/hash_in_worker_ab-h200.txt``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

OUT = "/dev/shm/hq-ab"
SPLIT = (
    "import atexit, resource, sys\n"
    "def _report():\n"
    "    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "    print(f'RU parent u {s.ru_utime:.1f} s {s.ru_stime:.1f} | workers u {c.ru_utime:.1f} s {c.ru_stime:.1f}', file=sys.stderr)\n"
    "atexit.register(_report)\n"
)
CLI = "import sys; from hetquant.convert.cli import main; main(sys.argv[1:])"


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def once(src: str, recipe: str, workers: int, tree: str, split: bool) -> str:
    shutil.rmtree(OUT, ignore_errors=True)
    os.sync()
    env = {**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"}
    code = (SPLIT if split else "") + CLI
    c0, v0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), vmstat(), time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, "convert", src, OUT, "--recipe", recipe,
                        "--workers", str(workers)], env=env, capture_output=True, text=True)  # fmt: skip
    wall, c1, v1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN), vmstat()
    if p.returncode:
        return f"rc {p.returncode}: {p.stderr[-1000:]}"
    line = f"wall {wall:6.2f} user {c1.ru_utime - c0.ru_utime:6.1f} sys {c1.ru_stime - c0.ru_stime:6.1f}"
    if split:
        ru = [x for x in p.stderr.splitlines() if x.startswith("RU ")]
        moved = {k: v1[k] - v0.get(k, 0) for k in v1 if abs(v1[k] - v0.get(k, 0)) > 20000}
        line += f"\n   {ru[-1][3:] if ru else '?'}\n   vmstat {moved}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--trees", nargs="+", required=True, help="NAME=DIR, DIR holding hetquant/")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "awq-w4a16", "fp4"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--split", action="store_true")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    for _ in range(args.rounds):
        for recipe in args.recipes:
            for name, tree in trees.items():
                print(f"{recipe:10s} {name} {once(args.source, recipe, args.workers, tree, args.split)}", flush=True)  # fmt: skip
    shutil.rmtree(OUT, ignore_errors=True)


if __name__ == "__main__":
    main()
