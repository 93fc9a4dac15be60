"""Issue 30, eleventh round: ``blake3_tree.range_nodes`` alone, block rows of a 64 MB buffer hashed
as a worker hashes what it stores, at a file offset that is not chunk-aligned (so every row has
short edge nodes); best of 7, GB/s. Run it against two trees (PYTHONPATH) to compare.

    python benchmarks/archive/probes/range_nodes_speed.py [ROW_BYTES [FILE_OFFSET]]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from hetquant.formats.blake3_tree import range_nodes


def main() -> None:
    row = int(sys.argv[1]) if len(sys.argv) > 1 else 917_504  # a W8A8 block row: 128 × 7168
    base = int(sys.argv[2]) if len(sys.argv) > 2 else 1_234_567
    size = 5 << 30  # the file: a 5 GB shard
    buf = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    rows = buf.size // row - 1
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for i in range(rows):
            s = base + i * row
            range_nodes(size, buf[i * row : (i + 1) * row], s, s, s + row)
        best = min(best, time.perf_counter() - t)
    print(f"row {row}: {rows * row / best / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
