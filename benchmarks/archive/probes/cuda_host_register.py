"""Populate a private map of a file, cudaHostRegister it (read-only flag, then default) and copy it
to the GPU, timing each phase (benchmarks/README.md "Loader on a GPU": tried, abandoned — on the
H200 host nothing was printed within 200 s for a 3.07 GB shard).
    timeout 200 python benchmarks/archive/probes/cuda_host_register.py FILE.safetensors"""

import mmap
import os
import sys
import time

import torch

path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
with open(path, "rb") as f:
    while f.read(1 << 26):
        pass  # warm page cache
cudart = torch.cuda.cudart()
dst = torch.empty(size, dtype=torch.uint8, device="cuda")
for flags_name, flags in (("readonly", 8), ("default", 0)):
    for _ in range(3):
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        mm.madvise(22, 0, size)  # MADV_POPULATE_READ
        t1 = time.perf_counter()
        src = torch.frombuffer(mm, dtype=torch.uint8)
        err = cudart.cudaHostRegister(src.data_ptr(), size, flags)
        t2 = time.perf_counter()
        if int(err) != 0:
            print(flags_name, "register failed", err)
            break
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        cudart.cudaHostUnregister(src.data_ptr())
        t4 = time.perf_counter()
        del src
        mm.close()
        print(
            f"{flags_name}: populate {size / (t1 - t0) / 1e9:.1f} GB/s, register "
            f"{size / (t2 - t1) / 1e9:.1f} GB/s, H2D {size / (t3 - t2) / 1e9:.1f} GB/s, "
            f"unregister {(t4 - t3) * 1e3:.0f} ms, total {size / (t4 - t0) / 1e9:.1f} GB/s",
            flush=True,
        )
