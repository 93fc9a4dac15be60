"""Issue 30, tenth round: how the conversion's row kernels scale with processes on this host,
with no file system in the way — the compute ceiling of a conversion whose output is in memory.

Each of N forked processes dequantizes its own real-shape FP8 expert weight ([2048, 7168], 128 ×
128 block scales) a block row at a time, as a conversion's job does (``source_row_arrays``'s
kernel), and then quantizes the rows with one recipe's kernel: ``fp8`` (the dequantization alone:
bf16), ``awq`` (AWQ RTN into the whole weight's tensors), ``int4`` (the hybrid's experts),
``w8a8``, ``fp4`` (NVFP4 in the Ascend tile order, fp4's experts); ``copy`` is a plain copy of
the BF16 rows' size (memory bandwidth). All start together (a barrier) and run ``--seconds``; the
figure is source GB/s over all of them, and per process.

Eleventh round, the rest of what a conversion onto tmpfs must do besides its kernels, each in
bytes of *output* per second: ``hash`` BLAKE3-tree-hashes a BF16 weight's bytes a block row at a
time, as a worker hashes what it stores (``range_nodes``); ``pages`` makes tmpfs pages as the
writer does (a file of its own under ``--tmpfs``, mapped ``MADV_SEQUENTIAL``, each block row's
range ``MADV_POPULATE_WRITE``-d), ``--pages-gb`` per process, kept until all are timed. With the
kernels' rates these give a floor for a conversion's CPU time (benchmarks/notes/
convert-scaling.md, eleventh round).

    python benchmarks/archive/probes/kernel_scaling.py --procs 1 8 16 --json out.json

Also prints the CPU topology (threads per core), which decides what 16 "cores" can do.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from _measure import machine_info

from hetquant.formats._quant_native import awq_rtn_array, nvfp4_array
from hetquant.formats._rows_native import fp8_dequant_rows_array, int4_rows_array, w8a8_rows_array
from hetquant.formats.blake3_tree import range_nodes

N, K, B = 2048, 7168, 128  # a DeepSeek-V3 expert's gate: [moe_intermediate, hidden]


def _weight(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 0x7F, size=(N, K), dtype=np.uint8)  # no NaN code (0x7f)
    codes |= (rng.random((N, K)) < 0.5).astype(np.uint8) << 7  # random signs
    scales = (rng.random((N // B, K // B), dtype=np.float32) * 1e-3 + 1e-4).astype(np.float32)
    return codes, scales


QUANTIZE = {  # kind -> the recipe's kernel on a block row's BF16 rows (r: its first row)
    "fp8": lambda rows, r, out: rows,
    "awq": lambda rows, r, out: awq_rtn_array(rows, 128, out=out["awq"], row0=r),
    "int4": lambda rows, r, out: int4_rows_array(rows),
    "w8a8": lambda rows, r, out: w8a8_rows_array(rows),
    "fp4": lambda rows, r, out: nvfp4_array(rows, 2.0**-12, "tiled", out["fp4"], r),
}


def _one_pass(kind: str, codes: np.ndarray, scales: np.ndarray, buf: np.ndarray, out: dict) -> None:
    quantize = QUANTIZE[kind]
    for r in range(0, N, B):
        rows = fp8_dequant_rows_array(codes[r : r + B], scales[r // B], B, out=buf)
        if quantize(rows, r, out) is None:  # a kernel that declined: the figure would be void
            raise SystemExit(f"kernel_scaling: the {kind} kernel declined block row {r}")


def _hash_pass(data: np.ndarray) -> None:
    row = B * K * 2  # one block row of BF16 bytes
    for at in range(0, data.size, row):
        range_nodes(data.size, data[at : at + row], at, at, at + row)


def _pages(path: Path, nbytes: int, barrier) -> float:
    """Seconds to make ``nbytes`` of tmpfs pages in ``path`` a block row's range at a time."""
    row = B * K * 2
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes)
        m.madvise(mmap.MADV_SEQUENTIAL)
        barrier.wait()
        t0 = time.perf_counter()
        for at in range(0, nbytes, row):
            m.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), at, min(row, nbytes - at))
        m.close()
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _copy_pass(src: np.ndarray, dst: np.ndarray) -> None:
    for r in range(0, N, B):
        np.copyto(dst[r : r + B], src[r : r + B])


def _worker(kind: str, seconds: float, seed: int, barrier, results, pages: tuple) -> None:
    if kind == "pages":
        tmpfs, nbytes = pages
        dt = _pages(Path(tmpfs) / f"kernel-scaling-{seed}", nbytes, barrier)
        results.put(nbytes / dt)  # output bytes of pages made per second
        barrier.wait()  # every process timed before any file goes
        (Path(tmpfs) / f"kernel-scaling-{seed}").unlink()
        return
    codes, scales = _weight(seed)
    buf = np.empty((B, K), np.uint16)
    out = {
        "awq": {
            "qweight": np.empty((K, N // 8), np.int32),
            "qzeros": np.empty((K // 128, N // 8), np.int32),
            "scales": np.empty((K // 128, N), np.float16),
        },
        "fp4": (np.empty((K, N // 2), np.uint8), np.empty((K // 16, N), np.uint8)),
    }
    big_src, big_dst = np.ones((N, K), np.uint16), np.empty((N, K), np.uint16)
    hashed = big_src.view(np.uint8).reshape(-1)  # [N * K * 2] bytes
    runs = {"copy": lambda: _copy_pass(big_src, big_dst), "hash": lambda: _hash_pass(hashed)}
    run = runs.get(kind, lambda: _one_pass(kind, codes, scales, buf, out))
    per_pass = 2 * N * K if kind == "hash" else N * K  # hash: output bytes; else source bytes
    run()  # warm
    barrier.wait()
    t0, passes = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        run()
        passes += 1
    dt = time.perf_counter() - t0
    results.put(
        passes * per_pass / dt
    )  # source (FP8) bytes per second; copy: half the bytes copied


def measure(kind: str, procs: int, seconds: float, pages: tuple = ("/dev/shm", 1 << 30)) -> dict:
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    ps = [
        ctx.Process(target=_worker, args=(kind, seconds, i, barrier, results, pages))
        for i in range(procs)
    ]
    for p in ps:
        p.start()
    rates = [results.get() for _ in ps]
    for p in ps:
        p.join()
    return {
        "kind": kind,
        "procs": procs,
        "total_gbps": sum(rates) / 1e9,
        "per_proc_gbps": sum(rates) / procs / 1e9,
    }


def topology() -> dict:
    cpu = Path("/sys/devices/system/cpu")
    sib = sorted({(c / "topology/thread_siblings_list").read_text().strip() for c in cpu.glob("cpu[0-9]*") if (c / "topology").exists()})  # fmt: skip
    return {"cpus": os.cpu_count(), "sibling_sets": sib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--kinds", nargs="+", default=["fp8", "awq", "int4", "w8a8", "fp4", "copy", "hash", "pages"])  # fmt: skip
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--tmpfs", default="/dev/shm", help="where `pages` makes its files")
    ap.add_argument("--pages-gb", type=float, default=1.0, help="GB of pages each process makes")
    ap.add_argument("--json")
    a = ap.parse_args()
    doc = {"benchmark": "archive/probes/kernel_scaling.py", "machine": machine_info(), "seconds": a.seconds, "topology": topology(), "runs": []}  # fmt: skip
    print(doc["topology"], flush=True)
    for kind in a.kinds:
        for n in a.procs:
            r = measure(kind, n, a.seconds, (a.tmpfs, int(a.pages_gb * 1e9)))
            doc["runs"].append(r)
            print(f"{kind:5s} procs {n:3d}: {r['total_gbps']:7.2f} GB/s in all, {r['per_proc_gbps']:.3f} each", flush=True)  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
