"""The kernel registries: (format, backend) → prepare function, and the backends themselves; and
the CPU expert pool's kernels per expert-layer format.

Backends (``backends/``) register into it; ``ops.QuantLinear`` looks kernels up in it. Kept apart
from ``ops`` so that neither imports the other's module at import time: ``backends`` → ``registry``
← ``ops`` → ``backends``.

Expert pool: an expert-layer format declares the kernel family that computes it
(``ExpertLayerFormat.cpu_kernel``: ``"int4"``, ``"fp4_e2m1"``); the kernel modules register
their functions under that name (``int4_moe.py``: the INT4 GEMV and fused MoE call;
``fp4_gemv.py``: the FP4 GEMV) and the pool asks :func:`expert_kernels` for a layer's format —
no dtype of a stored tensor decides which kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hetquant.formats import HetquantError, WeightFormat
from hetquant.formats.base import ExpertLayerFormat, stored_metas

__all__ = [
    "BACKENDS",
    "EXPERT_KERNELS",
    "FLOAT_DTYPES",
    "KERNELS",
    "Backend",
    "ExpertKernels",
    "Kernel",
    "PrepareFn",
    "checked_shape",
    "expert_kernels",
    "register_backend",
    "register_expert_kernels",
    "register_kernel",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Backend:
    """Where kernels run. ``ops``: torch_npu or a stand-in namespace (npu only)."""

    name: str
    device: torch.device
    ops: Any = None
    tp_rank: int = 0  # a row-parallel shard's rank: static W8A8 adds quant_bias on rank 0 only


@dataclass(frozen=True)
class Kernel:
    """A prepared linear: ``fn(x [M, in]) -> y [M, out]`` in x.dtype, and what it runs."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    in_features: int
    out_features: int
    uses: str
    prepared: Mapping[str, torch.Tensor] = field(default_factory=dict)  # repacked, on device
    act_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES


PrepareFn = Callable[[WeightFormat, Mapping[str, torch.Tensor], Backend], Kernel]
KERNELS: dict[tuple[str, str], PrepareFn] = {}
"""(format name, backend name) → prepare function (repacks once, returns a ``Kernel``)."""
BACKENDS: dict[str, Callable[[int, Any], Backend]] = {}
"""backend name → factory ``(tp_rank, npu_ops) -> Backend``; raises when the device is absent."""


def register_kernel(fmt_name: str, *backends: str) -> Callable[[PrepareFn], PrepareFn]:
    """Decorator: register a prepare function for ``fmt_name`` on each of ``backends``."""

    def deco(fn: PrepareFn) -> PrepareFn:
        for backend in backends:
            if (fmt_name, backend) in KERNELS:
                raise RuntimeError(f"kernel ({fmt_name}, {backend}) registered twice")
            KERNELS[(fmt_name, backend)] = fn
        return fn

    return deco


def register_backend(name: str) -> Callable:
    def deco(factory: Callable[[int, Any], Backend]) -> Callable[[int, Any], Backend]:
        BACKENDS[name] = factory
        return factory

    return deco


@dataclass(frozen=True)
class ExpertKernels:
    """The CPU expert pool's kernels of one family: ``gemv(packed, scale, x, *, backend,
    threads, **options) -> [T, N]`` for one expert's matrix, and optionally ``moe(layer, x,
    experts, offsets, tokens, weights, **options) -> [T, H] | None``, the routed-expert sum of a
    subpool in one call (None: declined, the pool loops over experts with ``gemv``)."""

    gemv: Callable[..., torch.Tensor]
    moe: Callable[..., torch.Tensor | None] | None = None


EXPERT_KERNELS: dict[str, ExpertKernels] = {}
"""kernel family (``ExpertLayerFormat.cpu_kernel``) → its kernels."""


def register_expert_kernels(family: str, kernels: ExpertKernels) -> ExpertKernels:
    """Register the pool's kernels for expert-layer formats that declare ``family``."""
    if family in EXPERT_KERNELS:
        raise RuntimeError(f"expert kernels {family!r} registered twice")
    EXPERT_KERNELS[family] = kernels
    return kernels


def expert_kernels(fmt: ExpertLayerFormat) -> ExpertKernels:
    """The kernels that compute ``fmt``'s layers in the CPU expert pool."""
    family = fmt.cpu_kernel
    if family is None or family not in EXPERT_KERNELS:
        raise HetquantError(
            f"expert-layer format {fmt.name!r} declares CPU kernel {family!r}, which no kernel "
            f"module registers (registered: {sorted(EXPERT_KERNELS)}); the CPU expert pool "
            "cannot serve it"
        )
    return EXPERT_KERNELS[family]


def checked_shape(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """[out, in] of ``tensors`` after checking names, dtypes, shapes and finiteness."""
    try:
        n, k = fmt.from_stored(stored_metas(tensors))[1]
    except (KeyError, IndexError, ValueError, HetquantError) as exc:
        raise HetquantError(
            f"{fmt.name}: cannot read the weight shape from stored tensors {sorted(tensors)} "
            f"({type(exc).__name__}: {exc}); they are not what this format stores"
        ) from None
    fmt.check_stored(tensors, (n, k))
    if "weight_shape" in tensors and tensors["weight_shape"].tolist() != [n, k]:
        raise HetquantError(
            f"{fmt.name}: weight_shape {tensors['weight_shape'].tolist()} disagrees with the "
            f"packed tensors ([{n}, {k}]); the checkpoint is corrupt"
        )
    for name, t in tensors.items():
        if t.is_floating_point() and not _all_finite(t):
            raise HetquantError(f"{fmt.name}: stored tensor {name!r} contains NaN or Inf")
    return n, k


def _all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """``isfinite(t).all()`` in bounded memory (float8 has no isfinite: widened per chunk)."""
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk]
        if not bool(torch.isfinite(part.float() if part.element_size() == 1 else part).all()):
            return False
    return True
