"""Ascend W8A8 int8 formats, as msModelSlim writes them and vllm-ascend / MindIE read them.

Stored tensors for a linear weight W of shape [n, k] = [out, in] (names relative to the module):

==================  =====  ======  =========================================================
name                dtype  shape   value
==================  =====  ======  =========================================================
``weight``          I8     [n, k]  q = clamp(round_half_even(W / s), -128, 127)
``weight_scale``    F32    [n, 1]  s = up_bf16(max(rowmax|W| / 127, FLT_EPSILON))
``weight_offset``   F32    [n, 1]  0 (symmetric)
``input_scale``     F32    [1]     ``w8a8`` only: s_x = up_bf16(max((hi - lo) / 255, FLT_EPSILON))
``input_offset``    F32    [1]     ``w8a8`` only: z_x = round(-lo / s_x) - 128, in [-128, 127]
``deq_scale``       F32    [n]     ``w8a8`` only: s_x * s
``quant_bias``      I32    [n]     ``w8a8`` only: -z_x * sum_k q[n, k]
==================  =====  ======  =========================================================

``w8a8_dynamic`` (description type W8A8_DYNAMIC) stores the first three; ``w8a8`` (W8A8,
static per-tensor asymmetric activations) all seven, with lo = min(act_min, 0) and
hi = max(act_max, 0) from the calibrated activation range. Rounding is half-to-even
(``torch.round``, as msModelSlim). An all-zero row gets s = FLT_EPSILON (2^-23) and q = 0, as
msModelSlim floors every scale there; it dequantizes to exact zeros.

Scales the consumer holds exactly (issue #14 item 5). vllm-ascend declares ``weight_scale``,
``weight_offset`` and ``input_scale`` in the model dtype (``params_dtype``, BF16 for DeepSeek:
``quantization/methods/w8a8_dynamic.py:71-72``, MoE :205-211, ``w8a8_static.py:55, 70-71``)
and ``copy_`` rounds the F32 file value into it; codes computed against the F32 value then no
longer match the scale the kernel multiplies by (up to 2^-9 relative). So ``up_bf16`` rounds
each scale *up* to the nearest BF16 value (the consumer's dtype: ``HELD_SCALE_DTYPE``) — up, so
that ``|W| / s <= 127`` and nothing clips — and the codes are the correctly rounded quotients
against exactly that value: ``W / s`` in F32 is the correctly rounded quotient, and for BF16 or
F16 weights (at most 11 significant bits) over a BF16 scale it is never pushed onto or across a
half-integer, so rounding it equals rounding the exact quotient; F32 weights divide in F64. The
file keeps F32 (msModelSlim's dtype) holding that BF16 value, so F32 consumers read the same
number. ``deq_scale = s_x * s`` is then exact in F32 (two 8-bit significands). msModelSlim's
BF16 arithmetic (``ir/api/impl/int_quantization.py:80-83, 138``) also stores BF16 values, but
rounds the scale to nearest (a row's extreme may clip) and rounds ``W / s`` to BF16 before the
integer (``round(bf16(W / s))``, a double rounding): ``benchmarks/w8a8_scale_exact.py`` measures
the three.

Dequantization (msModelSlim convention): ``W ≈ (q - weight_offset) * weight_scale`` in F32.

Runtime ops: ``npu_dynamic_quant`` + ``npu_quant_matmul`` (W8A8_DYNAMIC) and the static W8A8
linear are emulated on CPU, with their formulas, in ``formats/w8a8_npu_ops.py``.

Sources: msModelSlim ``modelslim_v1/save/ascendv1.py`` (tensor set, F32 on disk, deq_scale and
quant_bias formulas; ``utils/deqscale.py``: deq_scale stays F32 for BF16 models) and
``ir/api/impl/int_quantization.py`` (scale, offset, eps floor); vllm-ascend ``w8a8_dynamic.py``,
``w8a8_static.py``, ``register_custom_ops.py``, ``modelslim_config.py``; CANN kernels
DynamicQuant (``dynamic_quant.h``: 127/max, Muls, CAST_RINT, scale out 1/(127/max)) and
AscendQuantV2 (F32 math, round-half-even, clamp); QuantBatchMatmulV3 README formulas; MindIE-LLM
``docs/zh/user_guide/feature/w8a8.md``.

Decisions and open points:

* ``w8a8`` also stores ``weight_scale``/``weight_offset``: msModelSlim V1 and MindIE's doc list
  only the other five, but vllm-ascend declares all seven parameters (weight_scale is used only
  on its compressed-tensors path), so they load cleanly and make ``dequantize`` exact. MindIE is
  assumed to ignore unknown tensors.
* Every scale/offset is F32 on disk (the V1 saver); MindIE's doc lists BF16 input_scale/offset
  for BF16 models, and vllm-ascend casts into params_dtype on load. FP16 models (int64
  deq_scale) are not supported: DeepSeek is BF16.
* ``quant_bias`` is exact integer arithmetic (msModelSlim goes through F32, which differs once
  |z_x * sum q| > 2^24).
  Linears with a float bias are not supported (DeepSeek has none).

Where the code lives: the per-row int8 codec in ``formats/w8a8_npu_rows.py``, the reference NPU
ops in ``formats/w8a8_npu_ops.py``, ``quant_model_description.json`` in
``formats/ascend_description.py``; this module holds the two registered formats and re-exports
the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._lazy import torch
from ._rows_native import w8a8_rows_array
from .arrays import NotNative, native
from .ascend_description import (
    DESCRIPTION_VERSION,
    QUANT_TYPE_FLOAT,
    QUANT_TYPE_W8A8,
    QUANT_TYPE_W8A8_DYNAMIC,
    description_entries,
    description_header,
)
from .base import Streaming, TensorMeta, WeightFormat, register
from .errors import HetquantError
from .w8a8_npu_ops import (
    QUANT_MATMUL_MAX_DIM,
    dynamic_quant,
    dynamic_quant_matmul,
    static_quant_matmul,
)
from .w8a8_npu_rows import (
    INT8_MAX,
    INT8_MIN,
    SCALE_FLOOR,
    activation_qparams,
    dequantize_int8,
    held_scale,
    weight_metas,
    weight_tensors,
)

__all__ = [
    "DESCRIPTION_VERSION",
    "INT8_MAX",
    "INT8_MIN",
    "QUANT_MATMUL_MAX_DIM",
    "QUANT_TYPE_FLOAT",
    "QUANT_TYPE_W8A8",
    "QUANT_TYPE_W8A8_DYNAMIC",
    "SCALE_FLOOR",
    "W8A8Dynamic",
    "W8A8Static",
    "activation_qparams",
    "description_entries",
    "description_header",
    "dynamic_quant",
    "dynamic_quant_matmul",
    "held_scale",
    "static_quant_matmul",
]

_WEIGHT_AXES: dict[str, tuple[int | None, int | None]] = {
    "weight": (0, 1),
    "weight_scale": (0, None),  # one scale per row, over the whole row
    "weight_offset": (0, None),
}


@dataclass(frozen=True)
class W8A8Dynamic(WeightFormat):
    """W8A8_DYNAMIC: int8 per-channel weight; activations quantized per token at run time."""

    name: ClassVar[str] = "w8a8_dynamic"
    native_quantize: ClassVar[bool] = True  # quantize_array
    quantizes_rows_into: ClassVar[frozenset[str]] = frozenset({"weight"})  # quantize_array(into=)
    keys: ClassVar[frozenset[str]] = frozenset({"weight", "weight_scale", "weight_offset"})

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[W8A8Dynamic, tuple[int, int]]:
        n, k = metas["weight"].shape
        return self, (n, k)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        return Streaming(self, dict.fromkeys(self.stored(shape), 0))

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        return weight_metas(shape, self.name)

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return dict(_WEIGHT_AXES)

    def quantize(self, weight: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """``name`` is the tensor's full name, used in error messages."""
        return weight_tensors(weight, name)

    def quantize_array(
        self, rows: np.ndarray, *, into: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`quantize` of numpy rows (``arrays``), by the kernel alone; the int8 codes
        computed into ``into["weight"]`` where given (``WeightFormat.quantizes_rows_into``)."""
        if rows.ndim != 2 or 0 in rows.shape:
            raise NotNative(f"{self.name}: shape {rows.shape}")
        dest = (into or {}).get("weight")
        q, scale = native(w8a8_rows_array(rows, q=dest), lambda: f"{self.name}: rows {rows.dtype}")
        return {"weight": q, "weight_scale": scale, "weight_offset": np.zeros_like(scale)}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_int8(self, tensors)


def _stat(value: float | torch.Tensor | None, key: str, name: str) -> torch.Tensor:
    if value is None:
        raise HetquantError(
            f"{name}: static W8A8 needs the calibrated activation range act_min and act_max of "
            f"this layer's input; {key} is missing. Calibrate first or use w8a8_dynamic"
        )
    t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    if t.numel() != 1 or not torch.isfinite(t).all():
        raise HetquantError(f"{name}: {key} must be one finite number, got {value!r}")
    return t  # (1,)


@dataclass(frozen=True)
class W8A8Static(WeightFormat):
    """W8A8: int8 per-channel weight; per-tensor static activations from calibration stats."""

    name: ClassVar[str] = "w8a8"
    keys: ClassVar[frozenset[str]] = W8A8Dynamic.keys | {
        "input_scale", "input_offset", "deq_scale", "quant_bias"
    }  # fmt: skip

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[W8A8Static, tuple[int, int]]:
        n, k = metas["weight"].shape
        return self, (n, k)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        axes: dict[str, int | None] = dict.fromkeys(self.stored(shape), 0)
        axes.update(input_scale=None, input_offset=None)  # from the activation range alone
        return Streaming(self, axes)

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        """Per-row tensors follow ``out``; the activation parameters are per tensor.

        ``quant_bias`` sums a row over all of ``in``: a row-parallel (``in``-split) shard keeps
        it whole, and the backend adds it on one rank only (vllm-ascend: TP rank 0).
        """
        axes = dict(_WEIGHT_AXES)
        axes.update(input_scale=(None, None), input_offset=(None, None))
        axes.update(deq_scale=(0, None), quant_bias=(0, None))
        return axes

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        metas = weight_metas(shape, self.name)
        n = shape[0]
        metas["input_scale"] = TensorMeta("F32", (1,))
        metas["input_offset"] = TensorMeta("F32", (1,))
        metas["deq_scale"] = TensorMeta("F32", (n,))
        metas["quant_bias"] = TensorMeta("I32", (n,))
        return metas

    def quantize(
        self,
        weight: torch.Tensor,
        *,
        act_min: float | torch.Tensor | None = None,
        act_max: float | torch.Tensor | None = None,
        name: str = "weight",
    ) -> dict[str, torch.Tensor]:
        """``act_min`` / ``act_max``: calibrated range of the layer input (required)."""
        lo, hi = _stat(act_min, "act_min", name), _stat(act_max, "act_max", name)
        if lo > hi:
            raise HetquantError(f"{name}: act_min {float(lo)} > act_max {float(hi)}")
        out = weight_tensors(weight, name)
        in_scale, in_offset = activation_qparams(lo, hi)
        q_sum = out["weight"].to(torch.int64).sum(dim=1)  # (n,)
        quant_bias = -q_sum * int(in_offset)  # (n,) exact; |.| <= 128 * 127 * k
        if quant_bias.abs().max() > torch.iinfo(torch.int32).max:
            raise HetquantError(f"{name}: quant_bias overflows int32; in_features is too large")
        out["input_scale"], out["input_offset"] = in_scale, in_offset
        out["deq_scale"] = (in_scale * out["weight_scale"]).squeeze(1)  # (n,)
        out["quant_bias"] = quant_bias.to(torch.int32)
        return out

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_int8(self, tensors)


register(W8A8Dynamic())
register(W8A8Static())
