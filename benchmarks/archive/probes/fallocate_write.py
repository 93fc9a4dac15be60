"""What reserving an output file's blocks costs: pwrite + fsync into a fallocated file against a
sparse one (``containers.allocate`` against the ``ftruncate`` it replaced), interleaved.

Each round writes ``--gib`` GiB in 8 MiB ``pwrite`` calls at increasing offsets (as jobs fill a
container), then fsyncs, once into a sparse file and once into a fallocated one, alternating
which goes first; prints the median seconds of each and the ratio fallocated / sparse.

Usage::

    python benchmarks/archive/probes/fallocate_write.py [--dir /tmp] [--gib 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from hetquant.convert.planning.containers import allocate

CHUNK = 8 << 20


def write(path: Path, size: int, reserve: bool) -> float:
    data = os.urandom(CHUNK)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        allocate(fd, size) if reserve else os.ftruncate(fd, size)
        for off in range(0, size, CHUNK):
            os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    size = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):
        for reserve in (r % 2 == 0, r % 2 == 1):
            times[reserve].append(write(args.dir / "fallocate-probe.bin", size, reserve))
    sparse, reserved = (statistics.median(times[k]) for k in (False, True))
    print(f"{size / 2**30:.2f} GiB, {args.repeats} rounds, load {os.getloadavg()[0]:.1f}: sparse {sparse:.2f} s, fallocated {reserved:.2f} s, ratio {reserved / sparse:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
