"""Native vs torch quantize of a [2048, 7168] bf16 weight in 128-row chunks, one torch thread,
median of 3 (benchmarks/README.md "Recipes convert", item 4).
    python benchmarks/archive/probes/quant_native_speed.py"""

import statistics
import time

import torch

from hetquant.formats.awq_w4a16 import AwqW4A16
from hetquant.formats.nvfp4 import Nvfp4
from hetquant.formats.nvfp4_ascend import _KMajorChunks

torch.set_num_threads(1)
w = (torch.randn(2048, 7168, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
amax = float(w.float().abs().amax())
chunks = [w[r : r + 128].contiguous() for r in range(0, w.shape[0], 128)]
cases = {
    "nvfp4 canonical": (Nvfp4(), lambda f, c: f.quantize(c, weight_amax=amax),
                        lambda f, c: f._quantize_torch(c, amax)),
    "nvfp4 K-major": (_KMajorChunks(), lambda f, c: f.quantize(c, weight_amax=amax),
                      lambda f, c: f._quantize_torch(c, amax)),
    "awq g128": (AwqW4A16(), lambda f, c: f.quantize(c), lambda f, c: f._quantize_torch(c)),
}  # fmt: skip


def timed(fn) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for c in chunks:
            fn(c)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


for name, (fmt, native, reference) in cases.items():
    native(fmt, chunks[0])  # build the kernel once
    t_torch = timed(lambda c, f=fmt, r=reference: r(f, c))
    t_native = timed(lambda c, f=fmt, n=native: n(f, c))
    print(f"{name:16s} torch {t_torch * 1e3:7.1f} ms  native {t_native * 1e3:6.1f} ms  "
          f"{t_torch / t_native:5.1f}x")  # fmt: skip
