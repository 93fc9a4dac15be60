"""How fast N processes can put bytes into tmpfs, by each route the writer could take.

Issue 30, seventh round: at two MoE layers the conversion on tmpfs is CPU-bound, and a profile of
``bf16`` (``perf``, 2-vCPU VM) put 42 % of its CPU in ``clear_page_erms``: every page a shared map
populates is zeroed first, which ``pwrite`` skips. So: 8 GiB written in 1.8 MB pieces (one BF16
block row) by N forked processes, each into its own slice, through

* ``mmap``: a ``MAP_SHARED`` map, each piece's pages populated (``MADV_POPULATE_WRITE``) and
  stored into, as ``convert/engine/writer.py`` does;
* ``huge``: the same after ``MADV_HUGEPAGE`` (a no-op where ``shmem_enabled`` is ``never``);
* ``pwrite``: ``os.pwrite`` (the inode lock serializes writers of one file);

into 1, 5 or N files; prints the host's THP settings and GB/s per cell.

Usage: ``python benchmarks/archive/probes/tmpfs_write_routes.py [/dev/shm/probe]`` (env
``PROBE_GB``, ``PROBE_N``: total GiB, process counts)
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import sys
import time

D = sys.argv[1] if len(sys.argv) > 1 else "/dev/shm/probe"
TOTAL = int(os.environ.get("PROBE_GB", "8")) << 30
PIECE = 128 * 7168 * 2  # one BF16 block row: 1.8 MB
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
BUF = os.urandom(PIECE)


def _per(n: int) -> int:
    return TOTAL // n // PIECE * PIECE


def worker(route: str, idx: int, n: int, nfiles: int, bar, q) -> None:
    per, path = _per(n), f"{D}/f{idx % nfiles}.bin"
    base = (idx // nfiles) * per  # this process's slice of its file
    fd = os.open(path, os.O_RDWR)
    m = None
    if route != "pwrite":
        m = mmap.mmap(fd, -(-n // nfiles) * per, mmap.MAP_SHARED)
        if route == "huge":
            try:
                m.madvise(MADV_HUGEPAGE)
            except OSError as e:
                q.put(("err", str(e)))
    bar.wait()
    t0 = time.perf_counter()
    for off in range(base, base + per, PIECE):
        if m is None:
            os.pwrite(fd, BUF, off)
        else:
            m.madvise(MADV_POPULATE_WRITE, off, PIECE)
            m[off : off + PIECE] = BUF
    q.put(time.perf_counter() - t0)
    if m is not None:
        m.close()
    os.close(fd)


def run(route: str, n: int, nfiles: int) -> tuple[float, list]:
    """Aggregate GB/s of ``n`` processes writing through ``route`` into ``nfiles`` files."""
    paths = [f"{D}/f{f}.bin" for f in range(nfiles)]
    for path in paths:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.ftruncate(fd, -(-n // nfiles) * _per(n))
        os.close(fd)
    ctx = mp.get_context("fork")
    bar, q = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(route, i, n, nfiles, bar, q)) for i in range(n)]
    for proc in procs:
        proc.start()
    bar.wait()
    t0 = time.perf_counter()
    res = [q.get() for _ in range(n)]
    dt = time.perf_counter() - t0
    for proc in procs:
        proc.join()
    for path in paths:
        os.unlink(path)
    return round(_per(n) * n / dt / 1e9, 2), [r for r in res if isinstance(r, tuple)][:1]


def main() -> None:
    os.makedirs(D, exist_ok=True)
    thp = "/sys/kernel/mm/transparent_hugepage/"
    info = {k: open(thp + k).read().strip() for k in ("shmem_enabled", "enabled")}
    info["mounts"] = [line for line in open("/proc/mounts") if "/dev/shm" in line]
    info["kernel"] = os.uname().release
    print(json.dumps(info, indent=1))
    for n in [int(x) for x in os.environ.get("PROBE_N", "1 4 16").split()]:
        routes = [("mmap", 1), ("mmap", 5), ("mmap", n), ("huge", 1), ("huge", 5),
                  ("pwrite", 1), ("pwrite", 5), ("pwrite", n)]  # fmt: skip
        for route, nf in routes:
            if nf <= n:
                gbs, errs = run(route, n, nf)
                print(f"n={n:2d} {route:6s} files={nf:2d} {gbs:6.2f} GB/s {errs}", flush=True)


if __name__ == "__main__":
    main()
