"""A subpool runs the kernels its layer's format names in the registry (``_subpool.py``): a
stand-in registered for the family is what the pool calls, and gives the registered kernel's
bits; no stored dtype decides."""

from __future__ import annotations

from pathlib import Path

import torch
from gemv_reference import routing

from hetquant.runtime.experts.expert_pool import CpuExpertPool
from hetquant.runtime.kernels.registry import EXPERT_KERNELS, ExpertKernels


def test_the_pool_calls_the_registered_kernels(tiny_hybrid: Path, monkeypatch) -> None:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    with CpuExpertPool.open(tiny_hybrid, subpools=2, fused=False) as pool:
        layer = pool.layers[0]
        ids, w = routing(4, pool.info(layer).num_experts, 2, seed=4)
        want = pool.forward(layer, x, ids, w)
    real = EXPERT_KERNELS["int4"]
    calls: list[tuple[int, ...]] = []

    def gemv(packed: torch.Tensor, *args, **kw) -> torch.Tensor:
        calls.append(tuple(packed.shape))
        return real.gemv(packed, *args, **kw)

    monkeypatch.setitem(EXPERT_KERNELS, "int4", ExpertKernels(gemv=gemv))  # no fused call
    with CpuExpertPool.open(tiny_hybrid, subpools=2) as pool:
        got = pool.forward(layer, x, ids, w)
    assert calls and torch.equal(got, want)
