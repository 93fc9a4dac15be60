"""What limits convert's per-core rate as workers are added: each part alone, over N processes.

Issue #16 saw bf16 convert drop from 0.107 GB/s on one worker to ~0.045 GB/s per worker with 16
busy. This probe runs the parts of a bf16 job in N forked processes at once (N = 1, 4, ... up
to the cores) and prints the aggregate rate, so a part that does not scale stands out:

* ``pwrite-one``: 1.8 MB ``pwrite`` s (one BF16 block row) into ONE shared file, disjoint ranges
  (the inode lock serializes writers of one file);
* ``pwrite-own``: the same into one file per process;
* ``mmap-one``: the same bytes stored into a shared memory map of ONE file, each piece's pages
  populated first (``MADV_POPULATE_WRITE``), as ``convert/engine/writer.py`` does;
* ``dequant``: the FP8 → BF16 kernel on a cached block row (compute and cache bandwidth);
* ``map-read``: the kernel over a private memory map of a shared source file, each process its
  own slice, first touch (page faults and page-cache reads, what a worker does to its source);
* ``hash``: sha256 of cached 8 MB buffers (the hashing threads' work).

Usage: ``python benchmarks/archive/probes/convert_scaling_parts.py SOURCE_SHARD [--dir /dev/shm] [--mb 256]``
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

ROW_BYTES = 128 * 7168  # one FP8 block row of a 7168-wide weight


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from hetquant.formats._rows_native import fp8_dequant_rows

    return fp8_dequant_rows(codes, scales, 128)


def part(kind: str, rank: int, n: int, args: argparse.Namespace, barrier, out) -> None:
    torch.set_num_threads(1)
    total = args.mb << 20
    g = torch.Generator().manual_seed(rank)
    codes = torch.randint(0, 126, (128, 7168), generator=g, dtype=torch.uint8)
    codes = codes.view(torch.float8_e4m3fn)
    scales = torch.rand(56, generator=g) * 1e-3
    block = _dequant(codes, scales).view(torch.uint8).reshape(-1).numpy()
    fd = None
    if kind.startswith(("pwrite", "mmap")):
        name = f"own{rank}" if kind.endswith("own") else "one"
        fd = os.open(Path(args.dir) / f"probe-{name}", os.O_RDWR | os.O_CREAT, 0o644)
    if kind == "mmap-one":
        os.ftruncate(fd, n * total)  # every process: the same final size
        out_map = mmap.mmap(fd, n * total, mmap.MAP_SHARED)
    mm = None
    if kind == "map-read":
        with open(args.source, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    barrier.wait()
    t0 = time.perf_counter()
    done = 0
    if kind.startswith("pwrite"):
        base = rank * total if kind == "pwrite-one" else 0
        while done < total:
            done += os.pwrite(fd, block, base + done)
    elif kind == "mmap-one":
        src = torch.from_numpy(block)
        while done + len(block) <= total:
            pos = rank * total + done
            first = pos // mmap.PAGESIZE * mmap.PAGESIZE
            out_map.madvise(23, first, pos + len(block) - first)  # MADV_POPULATE_WRITE
            torch.frombuffer(out_map, dtype=torch.uint8, count=len(block), offset=pos).copy_(src)
            done += len(block)
    elif kind == "dequant":
        while time.perf_counter() - t0 < 2.0:
            _dequant(codes, scales)
            done += ROW_BYTES
    elif kind == "map-read":
        size = len(mm) // n // ROW_BYTES * ROW_BYTES
        start = rank * size
        for off in range(start, start + min(size, total // 2), ROW_BYTES):
            rows = torch.frombuffer(mm, dtype=torch.uint8, count=ROW_BYTES, offset=off)
            rows = rows.view(torch.float8_e4m3fn).reshape(128, 7168)
            _dequant(rows, scales)
            done += ROW_BYTES
    elif kind == "hash":
        buf = os.urandom(8 << 20)
        h = hashlib.sha256()
        while done < total:
            h.update(buf)
            done += len(buf)
    out.put(done / (time.perf_counter() - t0))
    if fd is not None:
        os.close(fd)


def run(kind: str, n: int, args: argparse.Namespace) -> float:
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=part, args=(kind, r, n, args, barrier, out)) for r in range(n)]
    for p in procs:
        p.start()
    rates = [out.get() for _ in procs]
    for p in procs:
        p.join()
    for f in Path(args.dir).glob("probe-*"):
        f.unlink()
    return sum(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a large source shard (map-read)")
    ap.add_argument("--dir", default="/dev/shm", help="where pwrite parts write")
    ap.add_argument("--mb", type=int, default=256, help="MB per process for pwrite and hash")
    ap.add_argument("--kinds", nargs="*", default=["pwrite-one", "pwrite-own", "mmap-one", "dequant", "map-read", "hash"])  # fmt: skip
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = sorted({c for c in (1, 2, 4, 8, 16) if c <= cores} | {min(cores, 16)})
    print(f"{cores} cores; aggregate GB/s (bytes of the part's input) for N processes")
    print("part        " + "".join(f"{n:>9d}" for n in counts) + "   per-process at max / at 1")
    for kind in args.kinds:
        rates = [run(kind, n, args) / 1e9 for n in counts]
        print(f"{kind:<12}" + "".join(f"{r:9.2f}" for r in rates) + f"   {rates[-1] / counts[-1] / rates[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
