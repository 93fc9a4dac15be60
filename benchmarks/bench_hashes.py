"""The manifest's file digest, sha256 against BLAKE3, and what ``verify`` and ``publish`` then
cost: GB/s from the page cache, interleaved per round, and the time extrapolated to an artifact
of ``--artifact-gb`` (DeepSeek-R1's 690 GB by default) at each rate.

    python benchmarks/bench_hashes.py --files 4 --size-gb 0.5 --work /dev/shm/hqh --json benchmarks/results/bench_hashes.json

Rows: one file hashed by one stream (``file_digest``: sha256; BLAKE3 on one thread; BLAKE3 on
every core), ``verify``'s pass over all files (``digest_files``: several files at once, schema 3
BLAKE3 vs schema 2 sha256), and the sha256 pass huggingface_hub makes before a legacy-LFS upload
(``_compute_missing_sha256s``: ``sha_fileobj`` on ``upload_folder``'s 5 threads; with hf_xet the
same sha256 is computed by hf_xet while it chunks the upload).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import machine_info, median, warm_page_cache, write_result
from bench_verify import synthetic

from hetquant.convert.engine.manifest import cores, digest_files, file_digest
from hetquant.formats.file_digests import DIGESTS

HUB_THREADS = 5  # huggingface_hub's upload_folder / create_commit default num_threads


def hub_sha256_pass(paths: list[Path]) -> None:
    """What huggingface_hub does for files whose sha256 it lacks (legacy LFS upload)."""
    from huggingface_hub.utils.sha import sha_fileobj

    def one(p: Path) -> bytes:
        with open(p, "rb") as f:
            return sha_fileobj(f)

    with ThreadPoolExecutor(HUB_THREADS) as ex:
        list(ex.map(one, paths))


def cases(paths: dict[str, Path]) -> dict[str, tuple[int, Any]]:
    """Row name → (bytes it hashes, the call)."""
    first = next(iter(paths.values()))
    one, every = first.stat().st_size, sum(p.stat().st_size for p in paths.values())
    sha, b3 = DIGESTS["sha256"], DIGESTS["blake3"]
    return {
        "one file: sha256": (one, lambda: file_digest(first, sha)),
        "one file: blake3, 1 thread": (one, lambda: file_digest(first, b3, 1)),
        f"one file: blake3, {cores()} threads": (one, lambda: file_digest(first, b3, cores())),
        "verify, schema 2 (sha256)": (every, lambda: digest_files(paths, algorithm=sha)),
        "verify, schema 3 (blake3)": (every, lambda: digest_files(paths, algorithm=b3)),
        f"publish: hub sha256 pass ({HUB_THREADS} threads)": (
            every,
            lambda: hub_sha256_pass(list(paths.values())),
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/hetquant-bench-hashes"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--artifact-gb", type=float, default=690.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    paths = synthetic(args.work, args.files, int(args.size_gb * 1e9))
    try:
        warm_page_cache(paths.values())
        rows = cases(paths)
        times: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(args.rounds):
            for name, (_, call) in rows.items():
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    out = {}
    print(f"{'row':<40} {'GB/s':>7} {f'{args.artifact_gb:.0f} GB at it':>14}")
    for name, (nbytes, _) in rows.items():
        gbps = nbytes / median(times[name]) / 1e9
        out[name] = {"bytes": nbytes, "seconds": times[name], "gbps": gbps}
        print(f"{name:<40} {gbps:>7.2f} {args.artifact_gb / gbps:>12.0f} s")
    if args.json:
        doc = {"benchmark": "bench_hashes", "machine": machine_info(), "cores": cores(),
               "files": args.files, "artifact_gb": args.artifact_gb, "rows": out}  # fmt: skip
        write_result(args.json, doc)


if __name__ == "__main__":
    main()
