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

Runtime ops (torch_npu contracts, ascend_formats.md §3), emulated on CPU by the functions here:

* W8A8_DYNAMIC, ``npu_dynamic_quant`` + ``npu_quant_matmul(pertoken_scale=...)``: per token
  r = 127 / rowmax|x| (F32), x_q = rint(x * r), x_scale = 1 / r; then, accumulating in int32,
  ``y = dtype_x( f32(x_q @ q.T) * weight_scale * x_scale )``.
* W8A8 (vllm-ascend ``w8a8_static``): ``x_q = clamp(rint(x * (1/input_scale) + input_offset))``
  (``npu_quantize``, div_mode=False); ``y = dtype_x( f32(x_q @ q.T + quant_bias) * deq_scale )``.

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
* Not verified on hardware: exact F32 dequant in the matmul (the fixpipe may truncate the
  scale), correctly rounded F32 division on the vector unit, and ``npu_dynamic_quant`` on an
  all-zero row (kernel: scale 1/inf = 0, CANN golden: 1; y = 0 either way; here 0 and 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._lazy import torch
from ._rows_native import w8a8_rows, w8a8_rows_array
from .arrays import NotNative, native
from .base import Streaming, TensorMeta, WeightFormat, all_finite, get_format, register
from .dtypes import round_up_to
from .errors import HetquantError

__all__ = [
    "DESCRIPTION_VERSION",
    "QUANT_MATMUL_MAX_DIM",
    "QUANT_TYPE_FLOAT",
    "QUANT_TYPE_W8A8",
    "QUANT_TYPE_W8A8_DYNAMIC",
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

INT8_MIN, INT8_MAX = -128, 127
ASYM_LEVELS = 255  # 2**8 - 1 steps across [lo, hi]
SCALE_FLOOR = 2.0**-23  # FLT_EPSILON: msModelSlim's lower bound for every scale
HELD_SCALE_DTYPE = "BF16"  # the dtype consumers hold scales in (vllm-ascend: the model's)
QUANT_MATMUL_MAX_DIM = 65535  # npu_quant_matmul: last dim of x1 (k) and x2 (n) at most this

QUANT_TYPE_W8A8_DYNAMIC = "W8A8_DYNAMIC"
QUANT_TYPE_W8A8 = "W8A8"
QUANT_TYPE_FLOAT = "FLOAT"
DESCRIPTION_VERSION = "1.0.0"  # msModelSlim ascendV1 saver
_QUANT_TYPE_OF_FORMAT = {
    "w8a8_dynamic": QUANT_TYPE_W8A8_DYNAMIC,
    "w8a8": QUANT_TYPE_W8A8,
    "bf16": QUANT_TYPE_FLOAT,
    "w4a8_dynamic": "W4A8_DYNAMIC",  # formats/w4a8_npu.py
    "ct_pack_quantized": "W4A16",  # vllm-ascend's W4A16 MoE scheme reads this layout
}
_ANY_SHAPE = (1, 1)  # stored-tensor names of these formats do not depend on the shape
_WEIGHT_AXES: dict[str, tuple[int | None, int | None]] = {
    "weight": (0, 1),
    "weight_scale": (0, None),  # one scale per row, over the whole row
    "weight_offset": (0, None),
}


def _checked_weight(weight: torch.Tensor, name: str, finite: bool = True) -> torch.Tensor:
    """``weight`` as F32 [n, k] after refusing what cannot be quantized."""
    if weight.ndim != 2 or 0 in weight.shape:
        raise HetquantError(
            f"{name}: expected a non-empty 2-D weight [out, in], got shape {list(weight.shape)}; "
            "only linear weights can be stored as W8A8"
        )
    if not weight.is_floating_point():
        raise HetquantError(f"{name}: weight must be float, got {weight.dtype}; dequantize it")
    w = weight.to(torch.float32)
    if finite and not all_finite(w):
        bad = ~torch.isfinite(w)
        row, col = (int(i) for i in bad.nonzero()[0])
        raise HetquantError(
            f"{name}: {int(bad.sum())} NaN/Inf values (first at [{row}, {col}]); the source "
            "checkpoint or its dequantization is corrupt, fix it before quantizing"
        )
    return w


def held_scale(x: torch.Tensor) -> torch.Tensor:
    """Positive ``x`` (float64) floored at FLT_EPSILON and rounded up to ``HELD_SCALE_DTYPE``:
    the F32 scale a consumer holds exactly (module docstring)."""
    return round_up_to(x.clamp(min=SCALE_FLOOR), HELD_SCALE_DTYPE).to(torch.float32)


def _weight_tensors(weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """Symmetric per-row int8 of ``weight`` [n, k]: weight, weight_scale, weight_offset."""
    fast = w8a8_rows(weight) if weight.ndim == 2 and 0 not in weight.shape else None
    if fast is not None:  # the fused kernel: the same bytes, no float32 copy
        q, scale = fast
        return {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}
    w = _checked_weight(weight, name, finite=False)  # (n, k) F32
    amax = w.abs().amax(dim=1, keepdim=True)  # (n, 1); NaN/Inf propagate
    if not all_finite(amax):
        _checked_weight(weight, name)  # raises, naming the first bad value
    scale = held_scale(amax.double() / INT8_MAX)  # (n, 1), >= amax / 127
    narrow = weight.dtype in (torch.bfloat16, torch.float16)  # their F32 quotient rounds exactly
    exact = w if narrow else w.double()  # F32 weights: an F64 quotient
    q = (exact / scale).round_().clamp_(INT8_MIN, INT8_MAX).to(torch.int8)  # (n, k)
    return {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}


def _weight_metas(shape: tuple[int, int], fmt: str) -> dict[str, TensorMeta]:
    if len(shape) != 2 or min(shape) <= 0:
        raise HetquantError(f"{fmt}: stores 2-D weights [out, in] only, got shape {list(shape)}")
    n, k = shape
    return {
        "weight": TensorMeta("I8", (n, k)),
        "weight_scale": TensorMeta("F32", (n, 1)),
        "weight_offset": TensorMeta("F32", (n, 1)),
    }


def _check_tensors(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise unless ``tensors`` are exactly what ``fmt`` stores for their ``weight``."""
    if "weight" not in tensors or tensors["weight"].ndim != 2:
        raise HetquantError(f"{fmt.name}: no 2-D 'weight' among {sorted(tensors)}")
    fmt.check_stored(tensors, tuple(tensors["weight"].shape))


def _dequantize(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    _check_tensors(fmt, tensors)
    q = tensors["weight"].to(torch.float32)  # (n, k)
    return (q - tensors["weight_offset"]) * tensors["weight_scale"]  # (n, k)


@dataclass(frozen=True)
class W8A8Dynamic(WeightFormat):
    """W8A8_DYNAMIC: int8 per-channel weight; activations quantized per token at run time."""

    name: ClassVar[str] = "w8a8_dynamic"
    native_quantize: ClassVar[bool] = True  # quantize_array
    keys: ClassVar[frozenset[str]] = frozenset({"weight", "weight_scale", "weight_offset"})

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[W8A8Dynamic, tuple[int, int]]:
        n, k = metas["weight"].shape
        return self, (n, k)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        return Streaming(self, dict.fromkeys(self.stored(shape), 0))

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        return _weight_metas(shape, self.name)

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return dict(_WEIGHT_AXES)

    def quantize(self, weight: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """``name`` is the tensor's full name, used in error messages."""
        return _weight_tensors(weight, name)

    def quantize_array(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`quantize` of numpy rows (``arrays``), by the kernel alone."""
        if rows.ndim != 2 or 0 in rows.shape:
            raise NotNative(f"{self.name}: shape {rows.shape}")
        q, scale = native(w8a8_rows_array(rows), f"{self.name}: rows {rows.dtype}")
        return {"weight": q, "weight_scale": scale, "weight_offset": np.zeros_like(scale)}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _dequantize(self, tensors)


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


def activation_qparams(
    act_min: torch.Tensor, act_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """msModelSlim per-tensor asymmetric int8: F32 [1] range -> (input_scale, input_offset);
    the scale held exactly in BF16, rounded up (module docstring)."""
    lo, hi = act_min.clamp(max=0.0).double(), act_max.clamp(min=0.0).double()
    scale = held_scale((hi - lo) / ASYM_LEVELS)  # (1,) F32
    return scale, (torch.round(-lo / scale) + INT8_MIN).float()  # (1,), (1,)


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
        metas = _weight_metas(shape, self.name)
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
        out = _weight_tensors(weight, name)
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
        return _dequantize(self, tensors)


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_dynamic_quant(x)``: x [..., k] -> (x_q I8 [..., k], x_scale F32 [...])."""
    if not torch.isfinite(x).all():
        raise HetquantError("dynamic_quant: activations contain NaN/Inf")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)  # (..., 1)
    recip = INT8_MAX / amax  # (..., 1); inf for an all-zero row
    x_q = torch.where(amax > 0, torch.round(xf * recip), 0.0)  # (..., k); |.| <= 127
    return x_q.to(torch.int8), (1.0 / recip).squeeze(-1)


def _int_matmul(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """int32 accumulation of x_q [..., k] @ weight[n, k].T -> I32 [..., n] (npu_quant_matmul)."""
    n, k = weight.shape
    if x_q.shape[-1] != k:
        raise HetquantError(
            f"quant matmul: x [..., {x_q.shape[-1]}] does not match weight [{n}, {k}]"
        )
    if max(n, k) > QUANT_MATMUL_MAX_DIM:
        raise HetquantError(
            f"quant matmul: npu_quant_matmul takes k and n <= {QUANT_MATMUL_MAX_DIM}, got "
            f"[{n}, {k}]; split the weight along n (as vllm-ascend does for q_b_proj)"
        )
    return x_q.to(torch.int32) @ weight.to(torch.int32).T  # (..., n); no overflow for k<=65535


def dynamic_quant_matmul(
    x: torch.Tensor, tensors: Mapping[str, torch.Tensor], *, param_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference W8A8_DYNAMIC linear: x [..., k] (BF16/FP16/F32) -> y [..., n] in x.dtype.

    ``param_dtype``: the dtype the engine holds ``weight_scale`` in; None keeps F32, BF16
    reproduces vllm-ascend (it loads weight_scale into a params_dtype parameter).
    """
    _check_tensors(W8A8Dynamic(), tensors)
    x_q, x_scale = dynamic_quant(x)  # (..., k), (...)
    acc = _int_matmul(x_q, tensors["weight"]).to(torch.float32)  # (..., n)
    w_scale = tensors["weight_scale"].reshape(-1)  # (n,)
    w_scale = w_scale.to(param_dtype or torch.float32).to(torch.float32)
    return (acc * w_scale * x_scale.unsqueeze(-1)).to(x.dtype)  # (..., n)


def static_quant_matmul(
    x: torch.Tensor, tensors: Mapping[str, torch.Tensor], *, param_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference W8A8 (static) linear: x [..., k] -> y [..., n] in x.dtype.

    ``param_dtype``: the dtype the engine holds ``input_scale`` in before taking its reciprocal;
    None keeps F32, BF16 reproduces vllm-ascend (input_scale is a params_dtype parameter).
    """
    _check_tensors(W8A8Static(), tensors)
    if not torch.isfinite(x).all():
        raise HetquantError("static_quant_matmul: activations contain NaN/Inf")
    in_scale = tensors["input_scale"].reshape(1).to(param_dtype or torch.float32)
    recip = (1.0 / in_scale).to(torch.float32)  # (1,), rounded to param_dtype first
    offset = tensors["input_offset"].reshape(1).to(torch.float32)  # (1,)
    x_q = torch.round(x.to(torch.float32) * recip + offset).clamp(INT8_MIN, INT8_MAX)  # (..., k)
    acc = _int_matmul(x_q.to(torch.int8), tensors["weight"]) + tensors["quant_bias"]  # (..., n)
    return (acc.to(torch.float32) * tensors["deq_scale"]).to(x.dtype)  # (..., n)


def description_entries(
    module_prefix: str, fmt_name: str, keys: Iterable[str] | None = None
) -> dict[str, str]:
    """``quant_model_description.json`` entries for one module stored in ``fmt_name``.

    Every stored tensor is listed (msModelSlim does so; vllm-ascend reads ``<prefix>.weight``,
    with ``weight_packed`` standing for ``weight``); ``keys``: the module's stored keys (default:
    the format's, for formats whose keys do not depend on the shape). Float tensors that are not
    a module weight (a layer bias, ``e_score_correction_bias``) are listed by the caller as
    ``{name: QUANT_TYPE_FLOAT}``.
    """
    try:
        quant_type = _QUANT_TYPE_OF_FORMAT[fmt_name]
    except KeyError:
        raise HetquantError(
            f"{module_prefix}: format {fmt_name!r} has no Ascend description type; "
            f"known: {', '.join(sorted(_QUANT_TYPE_OF_FORMAT))}"
        ) from None
    names = get_format(fmt_name).stored(_ANY_SHAPE) if keys is None else keys
    return {f"{module_prefix}.{local}": quant_type for local in names}


def description_header(model_quant_type: str = QUANT_TYPE_W8A8_DYNAMIC) -> dict[str, object]:
    """Top-level keys of ``quant_model_description.json``, in the order msModelSlim's ascendV1
    saver writes them after the per-tensor entries (``post_run``,
    ``core/quant_service/modelslim_v1/save/ascendv1.py:209-227``): ``version``,
    ``model_quant_type``, ``metadata`` (``{}`` without QuaRot), ``group_size`` (0 =
    per-channel), ``optional`` (``{}`` by default). Callers append it after the entries.

    DeepSeek's msModelSlim script forces ``W8A8_DYNAMIC`` for its mixed model (MindIE needs it).
    """
    known = (QUANT_TYPE_W8A8_DYNAMIC, QUANT_TYPE_W8A8, QUANT_TYPE_FLOAT)
    if model_quant_type not in known:
        raise HetquantError(f"model_quant_type {model_quant_type!r} is not one of {known}")
    return {
        "version": DESCRIPTION_VERSION,
        "model_quant_type": model_quant_type,
        "metadata": {},
        "group_size": 0,
        "optional": {},
    }


register(W8A8Dynamic())
register(W8A8Static())
