"""``hetquant verify``'s hashing: every file of an artifact one after another (before) against
``digest_files`` (several files at once), interleaved in one run, page cache warm.

    python benchmarks/bench_verify.py --files 10 --size-gb 1 --work /dev/shm/hqv   # synthetic
    python benchmarks/bench_verify.py --artifact out/tiny-hybrid                   # a real one

Prints each round's seconds and the ratio parallel / serial (median over rounds); ``--json``
records them with the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import machine_info, median, warm_page_cache, write_result

from hetquant.convert.engine.manifest import digest_files, file_digest, hash_threads


def synthetic(work: Path, files: int, size: int) -> dict[str, Path]:
    """``files`` files of ``size`` random-looking bytes (the last one half as large)."""
    work.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    out = {}
    for i in range(files):
        path, left = work / f"model-{i:05d}.safetensors", size if i < files - 1 else size // 2
        with open(path, "wb") as f:
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
        out[path.name] = path
    return out


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, help="hash this directory's files instead")
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/hetquant-bench-verify"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.artifact:
        paths = {
            str(p.relative_to(args.artifact)): p
            for p in sorted(args.artifact.rglob("*"))
            if p.is_file()
        }
    else:
        paths = synthetic(args.work, args.files, int(args.size_gb * 1e9))
    total = sum(p.stat().st_size for p in paths.values())
    warm_page_cache(paths.values())
    serial, parallel = [], []
    for r in range(args.rounds):
        serial.append(timed(lambda: {n: file_digest(p) for n, p in paths.items()}))
        parallel.append(timed(lambda: digest_files(paths)))
        print(f"round {r + 1}: one by one {serial[-1]:.2f} s, digest_files {parallel[-1]:.2f} s")
    assert digest_files(paths) == {n: file_digest(p) for n, p in paths.items()}
    ratio = median(parallel) / median(serial)
    gbps = total / median(parallel) / 1e9
    print(
        f"{len(paths)} files, {total / 1e9:.2f} GB, {hash_threads()} threads: "
        f"digest_files / one by one = {ratio:.3f} ({gbps:.2f} GB/s)"
    )
    if not args.artifact:
        shutil.rmtree(args.work)
    if args.json:
        doc = {
            "benchmark": "bench_verify",
            "machine": machine_info(),
            "files": len(paths),
            "bytes": total,
            "threads": hash_threads(),
            "serial_s": serial,
            "parallel_s": parallel,
            "ratio": ratio,
            "parallel_gbps": gbps,
        }
        write_result(args.json, doc)


if __name__ == "__main__":
    main()
