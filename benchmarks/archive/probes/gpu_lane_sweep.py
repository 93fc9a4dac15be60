"""CUDA load speed of an artifact for reader lanes x staging chunk sizes, medians of 3, page cache
warm (benchmarks/README.md "Loader on a GPU").  python benchmarks/archive/probes/gpu_lane_sweep.py ARTIFACT"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _measure import warm_page_cache

from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.loading import _reader, _staging

root = Path(sys.argv[1])
files = sorted(p for p in root.rglob("*") if p.is_file())


def one() -> float:
    warm_page_cache(files)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    art = open_artifact(root)
    w = art.load(ParallelLayout(), device="cuda")
    dt = time.perf_counter() - t0
    n = art.last_load.bytes_read
    del w
    return n / dt / 1e9


one()
for lanes in (4, 8, 12, 16):
    for stage_mib in (4, 16, 64):
        _staging.MAX_LANES, _reader._STAGE = lanes, stage_mib << 20
        print(lanes, stage_mib, round(statistics.median([one() for _ in range(3)]), 2), flush=True)
