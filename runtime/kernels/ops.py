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
w4a8_dynamic        int4 codes widened to int8 at load, then the w8a8_dynamic kernel of the backend
                    (same numbers; ``backends/w4a8.py``)
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

from collections.abc import Mapping
from typing import Any

import torch

from hetquant.formats import HetquantError, get_format

from . import backends as _backends  # noqa: F401  (registers kernels and backends)
from .registry import (
    BACKENDS,
    FLOAT_DTYPES,
    KERNELS,
    Backend,
    Kernel,
    checked_shape,
    register_backend,
    register_kernel,
)

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
