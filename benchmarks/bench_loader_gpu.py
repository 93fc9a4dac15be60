"""GPU half of the loader benchmark: pinned host→device limit vs ``load(device="cuda")``.

For each ``--artifact DIR`` (standalone: needs torch and the ``hetquant`` package importable):

(a) **H2D limit** (once): ``torch.empty(N, dtype=uint8, pin_memory=True)`` → ``copy_`` into a CUDA
    tensor of N bytes, N = 1 GiB, synchronized; one warm-up copy, then the median of 5. A pageable
    source is timed the same way for reference.
(b) **Loader**: page cache warm (every file of the artifact read once, untimed; resident fraction
    checked with ``mincore``), then ``open_artifact(DIR).load(ParallelLayout(), device="cuda")``
    timed from ``open_artifact`` to its return (``load`` synchronizes the device). The first load
    of the process is reported apart (``first_load_*``: CUDA caching allocator growth, pinned
    staging buffers); ``load_gbps`` is the median of ``--repeats`` loads after it, with up to 16
    reader threads (``lanes``, runtime/loading/_staging.py); ``load_1lane_gbps`` the same with one.
    GB/s counts ``last_load.bytes_read`` (tensor bytes). The last GPU load is checked byte for
    byte against a CPU load of the same artifact.
(c) For context, the same load to CPU (warm page cache) and a raw read of every file of the
    artifact (16 MiB reads into one reused buffer), medians of 3.

Prints one JSON object: ``{"h2d_gbps", "load_gbps", "ratio" (= load_gbps / h2d_gbps), ...}`` with
the first artifact's figures at the top level and every artifact's under ``"artifacts"``;
``--json PATH`` also writes it there.

``--cpu-dry-run``: no CUDA at all — (a) becomes a plain CPU copy of ``--dry-bytes`` and (b) loads
to ``cpu``; it only proves the code runs (the numbers mean nothing).

Usage::

    python benchmarks/bench_loader_gpu.py --artifact DIR [--artifact DIR2] [--json OUT.json]
    python benchmarks/bench_loader_gpu.py --artifact DIR --cpu-dry-run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import cached_fraction, read_files, warm_page_cache  # noqa: E402

from hetquant.runtime.loading import _staging  # noqa: E402

GiB = 1 << 30
RAW_BLOCK = 16 << 20


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def h2d(nbytes: int, repeats: int, dev: str, pinned: bool) -> dict[str, Any]:
    """Median GB/s of copying ``nbytes`` from host memory (pinned or not) to ``dev``."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)  # touch every page before timing
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for i in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        _sync(dev)
        if i:  # the first copy is a warm-up
            times.append(time.perf_counter() - t0)
    ok = bool(dst[:: max(1, nbytes // 4096)].eq(1).all())
    del src, dst
    med = statistics.median(times)
    return {
        "bytes": nbytes,
        "pinned": pinned,
        "s": times,
        "median_s": med,
        "gbps": nbytes / med / 1e9,
        "check": ok,
    }


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _raw(files: list[Path]) -> int:
    return read_files(files, RAW_BLOCK)


def _load(root: Path, dev: str) -> tuple[float, int, dict[str, torch.Tensor]]:
    from hetquant.runtime import ParallelLayout, open_artifact

    _sync(dev)
    t0 = time.perf_counter()
    art = open_artifact(root)
    tensors = art.load(ParallelLayout(), device=dev)
    dt = time.perf_counter() - t0  # load() synchronizes a CUDA device before returning
    return dt, art.last_load.bytes_read, tensors


def _one_lane_gbps(root: Path, files: list[Path], dev: str, repeats: int, nbytes: int) -> float:
    """The same load with one staging lane (reader thread): the single-thread baseline."""
    saved, _staging.MAX_LANES = _staging.MAX_LANES, 1
    try:
        times = []
        for _ in range(repeats):
            warm_page_cache(files)
            dt, _, w = _load(root, dev)
            times.append(dt)
            del w
    finally:
        _staging.MAX_LANES = saved
    return nbytes / statistics.median(times) / 1e9


def bench_artifact(root: Path, dev: str, repeats: int) -> dict[str, Any]:
    files = _files(root)
    file_bytes = sum(p.stat().st_size for p in files)
    warm_page_cache(files)
    out: dict[str, Any] = {"path": str(root), "files": len(files), "file_bytes": file_bytes}
    out["cached_before"] = cached_fraction(files)
    first_s, nbytes, w = _load(root, dev)
    out.update(first_load_s=first_s, first_load_gbps=nbytes / first_s / 1e9, bytes=nbytes)
    del w
    times = []
    for _ in range(repeats):
        warm_page_cache(files)
        dt, _, w = _load(root, dev)
        times.append(dt)
        if len(times) < repeats:
            del w
    med = statistics.median(times)
    out.update(load_s=times, load_median_s=med, load_gbps=nbytes / med / 1e9)
    out["lanes"] = _staging.lane_count(1 << 30)
    out["load_1lane_gbps"] = _one_lane_gbps(root, files, dev, repeats, nbytes)
    out["lanes_speedup"] = out["load_gbps"] / out["load_1lane_gbps"]
    # byte-for-byte check of the last device load against a CPU load
    cpu_times, ref = [], {}
    for _ in range(3):
        del ref
        warm_page_cache(files)
        dt, _, ref = _load(root, "cpu")
        cpu_times.append(dt)
    bad = [
        k
        for k, t in ref.items()
        if k not in w or not torch.equal(w[k].cpu().view(torch.uint8), t.view(torch.uint8))
    ]
    out["matches_cpu_load"] = not bad and len(w) == len(ref)
    out["mismatched"] = bad[:10]
    del w, ref
    out["cpu_load_s"] = cpu_times
    out["cpu_load_gbps"] = nbytes / statistics.median(cpu_times) / 1e9
    raw_times = []
    for _ in range(3):
        warm_page_cache(files)
        t0 = time.perf_counter()
        _raw(files)
        raw_times.append(time.perf_counter() - t0)
    out["raw_read_warm_gbps"] = file_bytes / statistics.median(raw_times) / 1e9
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, action="append", required=True, help="artifact dir")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--h2d-bytes", type=int, default=GiB)
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--cpu-dry-run", action="store_true", help="no CUDA: check the code runs")
    ap.add_argument("--dry-bytes", type=int, default=64 << 20, help="H2D bytes in a dry run")
    args = ap.parse_args()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("error: CUDA is not available here; use --cpu-dry-run to check the code on CPU")
    dev = "cpu" if dry else "cuda"
    nbytes = args.dry_bytes if dry else args.h2d_bytes
    t0 = time.perf_counter()
    pinned = h2d(nbytes, 5, dev, pinned=not dry)
    pageable = h2d(nbytes, 5, dev, pinned=False)
    arts = {str(a): bench_artifact(a.resolve(), dev, args.repeats) for a in args.artifact}
    first = next(iter(arts.values()))
    doc = {
        "h2d_gbps": pinned["gbps"],
        "load_gbps": first["load_gbps"],
        "ratio": first["load_gbps"] / pinned["gbps"],
        "artifact": str(args.artifact[0]),
        "dry_run": dry,
        "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(0),
        "h2d_pinned": pinned,
        "h2d_pageable": pageable,
        "artifacts": {
            k: {**v, "ratio_to_h2d": v["load_gbps"] / pinned["gbps"]} for k, v in arts.items()
        },
        "machine": {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": None if dry else torch.version.cuda,
            "kernel": platform.release(),
            "argv": sys.argv,
        },
        "total_s": round(time.perf_counter() - t0, 2),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
