"""The CPU expert pool before and after ``int4_moe``, and the AMX path against AVX-512 VNNI, in one
process (benchmarks/README.md, "One call per layer, and AMX").

1. Bit identity: ``int4_gemv`` on DeepSeek expert shapes, 1..70 tokens, every x86 path of this
   CPU (``HETQUANT_INT4_ISA``), all results equal.
2. GEMV GB/s of one [4096, 7168] gate_up matrix cycled through 64 copies (~940 MB, past the
   caches) per token count and thread count, AVX-512 VNNI against AMX (``--gemv``).
3. One DeepSeek MoE layer (``--experts`` of [7168, 2048], top-8) in ``CpuExpertPool``: the
   per-expert loop (``fused=False``) on AVX-512 VNNI — the pool as it was — against
   ``int4_moe`` on VNNI and on AMX, batches 1 / 8 / 64, 1 and 2 threads, the configurations
   interleaved, median ms per call; every configuration's outputs must be bit-identical.

The layer's bytes are random but fast to write (a lookup of random bytes; ``_kt.make_hybrid``'s
own generator takes minutes for 256 experts), in ``/tmp/ktb`` (reused by
``bench_kt_side_by_side.py --work /tmp/ktb``). Run from the repository root::

    python benchmarks/archive/probes/pool_amx_ab.py [--gemv] [--experts 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import _kt

_kt.import_hetquant()
from hetquant.runtime.experts.expert_pool import CpuExpertPool  # noqa: E402
from hetquant.runtime.kernels import int4_gemv as G  # noqa: E402

CONFIGS = [("loop", "avx512_vnni"), ("fused", "avx512_vnni"), ("fused", "amx_int8")]


def isa(name: str) -> None:
    os.environ["HETQUANT_INT4_ISA"] = name  # read on every call


def fast_bytes(rng: np.random.Generator, dtype: str, nbytes: int) -> bytes:
    if dtype == "U8":  # codes 1..15 in both nibbles
        v = np.arange(256)
        lut = ((1 + (v & 15) % 15) | ((1 + (v >> 4) % 15) << 4)).astype(np.uint8)
        return lut[np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)].tobytes()
    return rng.uniform(2e-3, 6e-3, nbytes // 4).astype(np.float32).tobytes()


def bit_identity() -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in [(4096, 7168), (7168, 2048), (7168, 1024), (100, 7168)]:
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        s = torch.rand(n, generator=g) + 0.1
        for t in [1, 2, 3, 5, 6, 11, 17, 27, 40, 70]:
            x = torch.randn(t, k, generator=g) * 3
            outs = []
            for name in G.isa_names():
                isa(name)
                outs.append(G.int4_gemv(w, s, x, backend="native", threads=3).view(torch.int32))
            assert all(torch.equal(outs[0], o) for o in outs), (n, k, t)
    print(f"gemv bit identity of {', '.join(G.isa_names())}: ok", flush=True)


def gemv_speed() -> None:
    n, k, copies = 4096, 7168, 64
    ws = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) for _ in range(copies)]
    s = torch.rand(n) + 0.5
    for t in [1, 2, 4, 8, 16, 32]:
        x = torch.randn(t, k)
        for th in [1, 2]:
            line = []
            for name in ["avx512_vnni", "amx_int8"]:
                isa(name)
                G.int4_gemv(ws[0], s, x, threads=th)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for w in ws:
                        G.int4_gemv(w, s, x, threads=th)
                    best = min(best, (time.perf_counter() - t0) / copies)
                line.append(f"{name} {n * k / 2 / best / 1e9:6.2f} GB/s")
            print(f"gemv [{n},{k}] T {t:2d} threads {th}: " + " | ".join(line), flush=True)


def pool_speed(experts: int) -> None:
    _kt._random_bytes = fast_bytes
    t0 = time.perf_counter()
    art = _kt.make_hybrid(Path("/tmp/ktb"), experts, 7168, 2048, 0, seed=0)
    print(f"artifact {time.perf_counter() - t0:.0f} s", flush=True)
    pools = {}
    for t in (1, 2):
        pools["loop", t] = CpuExpertPool.open(art, subpools=1, threads=t, fused=False)
        pools["fused", t] = CpuExpertPool.open(art, subpools=1, threads=t)
    g = torch.Generator().manual_seed(1)
    for b in [1, 8, 64]:
        for t in (1, 2):
            res: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
            for rep in range(3):
                calls = []
                for c in range(3):
                    ids, w = _kt.routing(b, experts, 8, seed=1000 * rep + 10 * b + c)
                    calls.append((torch.randn(b, 7168, generator=g).to(torch.bfloat16), ids, w))
                outs = {}
                for cfg in CONFIGS if rep % 2 == 0 else CONFIGS[::-1]:
                    isa(cfg[1])
                    p = pools[cfg[0], t]
                    t0 = time.perf_counter()
                    outs[cfg] = [p.forward(_kt.LAYER, x, ids, w) for x, ids, w in calls]
                    res[cfg].append((time.perf_counter() - t0) / len(calls))
                for cfg in CONFIGS[1:]:
                    assert all(map(torch.equal, outs[cfg], outs[CONFIGS[0]])), cfg
            line = " | ".join(f"{a}-{i} {statistics.median(v) * 1e3:7.1f} ms" for (a, i), v in res.items())  # fmt: skip
            print(f"pool b {b:2d} t {t}: {line}  (identical bits)", flush=True)
    for p in pools.values():
        p.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gemv", action="store_true", help="also the GEMV GB/s per token count")
    ap.add_argument("--experts", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(G.native_info(), flush=True)
    bit_identity()
    if args.gemv:
        gemv_speed()
    pool_speed(args.experts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
