"""INT4 GEMV throughput of one [4096, 7168] expert matrix (gate_up) cycled through ~264 MB of copies,
for a given kernel thread count and precision (benchmarks/README.md "CPU INT4 expert GEMV": the
in-call threads vs two single-thread processes side by side).

    python benchmarks/archive/probes/gemv_threads.py THREADS high|fast
    python benchmarks/archive/probes/gemv_threads.py 1 high & python benchmarks/archive/probes/gemv_threads.py 1 high; wait
"""

import os
import sys
import time

import torch

from hetquant.runtime.kernels.int4_gemv import int4_gemv

torch.set_num_threads(1)
N, K, COPIES = 4096, 7168, 18
ws = [torch.randint(0, 256, (N, K // 2), dtype=torch.uint8) for _ in range(COPIES)]
s = torch.rand(N) + 0.5
x = torch.randn(1, K)
threads, prec = int(sys.argv[1]), sys.argv[2]
int4_gemv(ws[0], s, x, threads=threads, precision=prec)  # build / warm up
t0, n = time.perf_counter(), 0
while time.perf_counter() - t0 < 4:
    for w in ws:
        int4_gemv(w, s, x, threads=threads, precision=prec)
        n += 1
dt = time.perf_counter() - t0
print(f"pid {os.getpid()} threads {threads} {prec}: {n * N * K / 2 / dt / 1e9:.2f} GB/s")
