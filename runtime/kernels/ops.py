"""Quantized linear ops: one format's stored tensors → ``y = x @ Wᵀ`` on a device backend.

``QuantLinear.from_stored(fmt_name, tensors, backend=...)`` looks up the kernel registered for
``(fmt_name, backend)``. It repacks the stored tensors once, at construction, into what that
backend's operators take, and returns a callable ``x [..., in] -> y [..., out]`` whose output has
``x.dtype``. Formats are looked up by name, never branched on (see ``KERNELS``); ``params`` are the
format's parameters, as for ``get_format`` (``{"group_size": 64}``).

What runs, per (format, backend) (``QuantLinear.uses`` says it for each instance):

==================  ==================================  ==========================================
format              cpu / cuda                          npu (torch_npu)
==================  ==================================  ==========================================
bf16                F.linear                            F.linear
w8a8_dynamic        per-token int8 quantization, exact  npu_dynamic_quant + npu_quant_matmul
                    int32 ``torch._int_mm``, F32 scales (vllm-ascend W8A8_DYNAMIC)
w8a8                static int8 quantization,           npu_quantize + npu_quant_matmul
                    ``torch._int_mm`` + quant_bias      (vllm-ascend w8a8_static)
awq_w4a16           int4 GEMM (*)                       sglang's repack + npu_weight_quant_batchmatmul
ct_pack_quantized   int4 GEMM (*)                       vllm-ascend's W4A16 repack
                                                        (npu_convert_weight_to_int4pack) + WQBMM
int4_cpu            int4 GEMM (*)                       refused: the CPU expert pool's format
nvfp4, nvfp4_ascend dequantize once (F32) + F.linear    chitu's soft FP4 (E2M1->BF16, folded BF16
                                                        scale) once at load, then a BF16 matmul
==================  ==================================  ==========================================

(*) cpu: ``torch._weight_int4pack_mm_for_cpu``, cuda: ``torch._weight_int4pack_mm``, where the
shapes fit; otherwise the weight is dequantized once (F32) and multiplied in float32.

The npu backend has NOT run on Ascend hardware. It follows torch_npu's documented op contracts
(reference/ascend_formats.md §3) and is tested against ``runtime.npu_emulation``, a CPU emulation of
exactly those documented semantics (shapes, dtypes, formulas); pass ``npu_ops=npu_emulation`` to run
it on CPU. Without ``npu_ops`` it imports the real ``torch_npu``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hetquant.formats import HetquantError, WeightFormat, get_format
from hetquant.formats.base import stored_metas

__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "KERNELS",
    "Backend",
    "Kernel",
    "QuantLinear",
    "checked_shape",
    "register_backend",
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


class QuantLinear:
    """``y = x @ Wᵀ`` for one stored linear weight on one backend (see the module docstring)."""

    def __init__(self, fmt_name: str, backend: Backend, kernel: Kernel) -> None:
        self.fmt_name = fmt_name
        self.backend = backend
        self.kernel = kernel

    @classmethod
    def from_stored(
        cls,
        fmt_name: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        backend: str,
        params: Mapping[str, Any] | None = None,
        npu_ops: Any = None,
        tp_rank: int = 0,
    ) -> QuantLinear:
        """Repack ``tensors`` (local names, e.g. ``weight``, ``weight_scale``) for ``backend``.

        Args:
            fmt_name: a registered format (``hetquant.formats.FORMATS``).
            tensors: the stored tensors of one linear, as the format writes them.
            backend: ``"cpu"``, ``"cuda"`` or ``"npu"``.
            params: the format's parameters (``get_format(fmt_name, **params)``).
            npu_ops: npu only: the torch_npu namespace to call; None imports ``torch_npu``,
                ``hetquant.runtime.kernels.npu_emulation`` runs the same calls on CPU.
            tp_rank: rank of a row-parallel (in-features split) shard; 0 otherwise. Only
                static W8A8 uses it: its ``quant_bias`` is added on rank 0 alone.

        Raises:
            HetquantError: unknown format or backend, no kernel for the pair, a backend whose
                device is absent, or stored tensors that do not match the format.
        """
        try:
            fmt = get_format(fmt_name, **dict(params or {}))
        except TypeError as exc:
            raise HetquantError(
                f"{fmt_name}: bad format params {dict(params or {})}: {exc}"
            ) from None
        if backend not in BACKENDS:
            raise HetquantError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        prepare = KERNELS.get((fmt_name, backend))
        if prepare is None:
            have = sorted(b for f, b in KERNELS if f == fmt_name)
            raise HetquantError(
                f"format {fmt_name!r} has no {backend} kernel; it has: {', '.join(have) or 'none'}"
            )
        if npu_ops is not None and backend != "npu":
            raise HetquantError(f"npu_ops is for backend='npu' only, not {backend!r}")
        ctx = BACKENDS[backend](tp_rank, npu_ops)
        return cls(fmt_name, ctx, prepare(fmt, dict(tensors), ctx))

    @property
    def in_features(self) -> int:
        return self.kernel.in_features

    @property
    def out_features(self) -> int:
        return self.kernel.out_features

    @property
    def uses(self) -> str:
        """What this instance runs (kernel names, or the dequantize fallback and why)."""
        return self.kernel.uses

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] → y [..., out], in x.dtype."""
        k, n = self.in_features, self.out_features
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[-1] != k:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise HetquantError(f"{self.fmt_name} linear: expected x [..., {k}], got {got}")
        if x.dtype not in self.kernel.act_dtypes:
            raise HetquantError(
                f"{self.fmt_name} on {self.backend.name} takes activations in "
                f"{', '.join(str(d) for d in self.kernel.act_dtypes)}, got {x.dtype}"
            )
        if x.device.type != self.backend.device.type:
            raise HetquantError(
                f"{self.fmt_name} linear: x is on {x.device}, the weights on "
                f"{self.backend.device}; move x there first"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, n)
        return self.kernel.fn(x2).reshape(*lead, n)

    def __repr__(self) -> str:
        return (
            f"QuantLinear({self.fmt_name}, {self.backend.name}, in={self.in_features}, "
            f"out={self.out_features}, uses={self.uses!r})"
        )


from . import backends as _backends  # noqa: E402, F401  (registers kernels and backends)
