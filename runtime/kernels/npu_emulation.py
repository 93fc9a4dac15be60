"""A CPU emulation of the torch_npu operators that hetquant's npu backend calls: their documented
contracts, and nothing more.

No Ascend hardware was available to write or test this. Each function implements, on CPU tensors,
what the torch_npu documentation states for the operator of the same name (Ascend/op-plugin
``docs/context/torch_npu-<op>.md``, summarized in reference/ascend_formats.md §3): the accepted
dtypes, shapes and dtype combinations, and the formula. An input the documentation rules out
raises ``RuntimeError``, as the real op's ``TORCH_CHECK`` does. A documented mode that hetquant
does not use raises ``NotImplementedError`` rather than guess. Pass this module as
``QuantLinear.from_stored(..., backend="npu", npu_ops=npu_emulation)`` to run the npu backend's
exact call sequence on CPU.

Operators:

* ``npu_dynamic_quant(x, *, smooth_scales, group_index, dst_type)``: per-token symmetric int8.
  x fp16/bf16, dim > 1; returns (int8 y of x's shape, F32 scale of x.shape[:-1]).
* ``npu_quantize(input, scales, zero_points, dtype, axis, div_mode)``: ``div_mode=False`` only:
  ``rint(input * scales + zero_points)`` saturated to qint8 (returned as torch.int8).
* ``npu_quant_matmul(x1, x2, scale, *, offset, pertoken_scale, bias, output_dtype, group_sizes)``:
  x1 int8 [.., m, k], x2 int8 [.., k, n], 2-6 dims, last dims <= 65535; the dtype combinations of
  the doc's Table 2 (Atlas A2/A3) with a float output: BF16 (scale F32/BF16, bias
  int32/BF16/F32/None, pertoken_scale F32/None) and FP16 (scale F32; with pertoken_scale any of
  those biases, without it int32/None). ``y = (x1@x2 [+ int32 bias]) * scale [* pertoken_scale]
  [+ float bias]``.
* ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, ..., bias,
  antiquant_group_size, inner_precise)``: x fp16/bf16 (M, K); weight int8 (K, N) or int4pack int32
  (K, N/8); per-tensor, per-channel or per-group (ceil(K/g), N) scale of x's dtype, offset alike;
  ``y = x @ ((weight + offset) * scale) + bias``; K, N <= 65535; no empty tensors.
* ``npu_convert_weight_to_int4pack(weight, inner_k_tiles)``: int32 (k, n), n % 8 == 0, values in
  [-8, 7] -> int32 (k, n/8), element j of each 8 in bits 4j..4j+3 (two's complement), as the
  op-plugin source ``convert_to_int4_pack`` packs them.
* ``npu_format_cast(input, acl_format, customize_dtype)``: identity on the values (FRACTAL_NZ is a
  device-side storage layout); returns a new tensor and records the format for
  ``get_npu_format``.

Where the documentation leaves the numbers open, this emulation chooses (the real kernels may differ):

1. npu_dynamic_quant: the doc gives ``scale = rowmax|x| / 127``, ``y = round(x / scale)``; the
   emulation follows the CANN DynamicQuant kernel as formats/w8a8_npu.py documents it:
   ``r = 127 / rowmax`` in F32, ``y = rint(x * r)`` (half to even), ``scale = 1 / r``; an all-zero row
   gives y = 0, scale = 0.
2. npu_quantize: F32 arithmetic, a multiply then an add (no fused multiply-add), round half to even,
   saturate to [-128, 127].
3. npu_quant_matmul: exact integer accumulation, then F32 products in the order acc * scale *
   pertoken_scale, one rounding to the output dtype. The doc's formulas do not place
   pertoken_scale relative to a float bias: the bias is added after it.
4. npu_weight_quant_batchmatmul: ``(weight + offset) * scale`` in F32, rounded once to x's dtype
   (the cube unit multiplies fp16/bf16), F32 accumulation, F32 bias, one rounding to x's dtype.
5. npu_convert_weight_to_int4pack: the doc calls the layout "interleaved" (交叠排放) but the op
   source stores element j in nibble j; the source is followed. The source masks values with 0xF
   without checking them; the emulation refuses values outside [-8, 7], which the doc requires.

Not emulated (NotImplementedError): int4 (int32) inputs and ``group_sizes`` of npu_quant_matmul,
its int8 and int32 outputs and int64 (``npu_trans_quant_param``) scales; ``quant_scale`` /
``quant_offset`` and int64 antiquant scales of npu_weight_quant_batchmatmul; ``group_index`` and
``quint4x2`` of npu_dynamic_quant; ``div_mode=True`` and ``quint4x2`` of npu_quantize; float32 (FP4)
input of npu_convert_weight_to_int4pack; formats other than ND and FRACTAL_NZ; NaN / Inf inputs,
for which the documentation defines no result.

Where the code lives: the two matmuls in ``runtime/kernels/npu_emulation_matmul.py``, the checks
and limits every op shares in ``runtime/kernels/_npu_checks.py``; this module holds the
quantization, packing and format ops and re-exports the matmuls, so that it is the whole op set.
"""

from __future__ import annotations

import torch

from ._npu_checks import HALF, INT8_MAX, check, check_finite
from .npu_emulation_matmul import npu_quant_matmul, npu_weight_quant_batchmatmul

__all__ = [
    "ACL_FORMAT_FRACTAL_NZ",
    "ACL_FORMAT_ND",
    "EMULATION_DEVICE",
    "get_npu_format",
    "npu_convert_weight_to_int4pack",
    "npu_dynamic_quant",
    "npu_format_cast",
    "npu_quant_matmul",
    "npu_quantize",
    "npu_weight_quant_batchmatmul",
]

EMULATION_DEVICE = torch.device("cpu")  # the npu backend places prepared tensors here
ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 2, 29
_FORMAT_ATTR = "_hetquant_npu_format"


def npu_dynamic_quant(
    x: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check(x.dtype in HALF, f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype}")
    check(x.dim() > 1, f"npu_dynamic_quant: x must have more than 1 dim, got {x.dim()}")
    if group_index is not None:
        raise NotImplementedError("npu_dynamic_quant: group_index (MoE) is not emulated")
    if dst_type == torch.quint4x2:
        raise NotImplementedError("npu_dynamic_quant: dst_type quint4x2 is not emulated")
    check(dst_type in (None, torch.int8), f"npu_dynamic_quant: dst_type {dst_type} unsupported")
    check_finite("npu_dynamic_quant: x", x)
    xf = x.to(torch.float32)
    if smooth_scales is not None:
        check(smooth_scales.dtype in HALF, "npu_dynamic_quant: smooth_scales must be fp16/bf16")
        check(
            tuple(smooth_scales.shape) == (x.shape[-1],),
            f"npu_dynamic_quant: smooth_scales must be 1-D ({x.shape[-1]},), "
            f"got {tuple(smooth_scales.shape)}",
        )
        xf = xf * smooth_scales.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)  # (..., 1)
    r = INT8_MAX / amax  # F32; inf for an all-zero row
    y = torch.where(amax > 0, torch.round(xf * r), 0.0)
    return y.to(torch.int8), (1.0 / r).squeeze(-1)


def npu_quantize(
    input: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    dtype: torch.dtype,
    axis: int = 1,
    div_mode: bool = True,
) -> torch.Tensor:
    if div_mode:
        raise NotImplementedError("npu_quantize: div_mode=True is not emulated")
    if dtype == torch.quint4x2:
        raise NotImplementedError("npu_quantize: dtype quint4x2 is not emulated")
    check(
        dtype == torch.qint8, f"npu_quantize: with div_mode=False dtype must be qint8, got {dtype}"
    )
    floats = (torch.float32, *HALF)
    check(input.dtype in floats, f"npu_quantize: input dtype {input.dtype} unsupported")
    check(scales.dtype in floats, f"npu_quantize: scales dtype {scales.dtype} unsupported")
    check(-2 <= axis < input.dim(), f"npu_quantize: axis {axis} outside [-2, {input.dim() - 1}]")
    ax = input.dim() - 2 if axis == -2 else input.dim() - 1
    size = input.shape[ax]
    if scales.dim() == 1:
        check(scales.shape[0] in (1, size), f"npu_quantize: scales size must be 1 or {size}")
        shape = [scales.shape[0]] + [1] * (input.dim() - 1 - ax)
    else:
        ok = scales.dim() == input.dim() and all(
            s == 1 or (d == ax and s == size) for d, s in enumerate(scales.shape)
        )
        check(ok, f"npu_quantize: scales shape {tuple(scales.shape)} does not fit input axis {ax}")
        shape = list(scales.shape)
    if zero_points is not None:
        check(
            zero_points.shape == scales.shape and zero_points.dtype == scales.dtype,
            "npu_quantize: zero_points must have the shape and dtype of scales",
        )
    check_finite("npu_quantize: input", input)
    y = input.to(torch.float32) * scales.to(torch.float32).reshape(shape)
    if zero_points is not None:
        y = y + zero_points.to(torch.float32).reshape(shape)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    name = "npu_convert_weight_to_int4pack"
    if weight.dtype == torch.float32:
        raise NotImplementedError(f"{name}: float32 (FP4) input is not emulated")
    check(weight.dtype == torch.int32, f"{name}: weight must be int32, got {weight.dtype}")
    check(weight.is_contiguous(), f"{name}: weight should be contiguous")
    check(weight.dim() == 2, f"{name}: weight must be 2-D (k, n) or (n, k), got {weight.dim()}-D")
    check(min(weight.shape) > 0, f"{name}: weight dim should be greater than 0")
    check(weight.shape[-1] % 8 == 0, f"{name}: weight last dim should be a multiple of 8")
    check(
        bool(((weight >= -8) & (weight <= 7)).all()),
        f"{name}: values must lie in [-8, 7] (torch_npu masks them to 4 bits unchecked)",
    )
    nib = (weight.to(torch.int64) & 0xF).reshape(weight.shape[0], -1, 8)
    word = (nib << torch.arange(0, 32, 4)).sum(dim=-1)  # disjoint bits: sum == or
    return (word - ((word >> 31) << 32)).to(torch.int32)


def npu_format_cast(
    input: torch.Tensor, acl_format: int, customize_dtype: torch.dtype | None = None
) -> torch.Tensor:
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise NotImplementedError(f"npu_format_cast: acl_format {acl_format} is not emulated")
    out = input.clone()
    setattr(out, _FORMAT_ATTR, acl_format)
    return out


def get_npu_format(tensor: torch.Tensor) -> int:
    """The format recorded by :func:`npu_format_cast` (ND for any other tensor)."""
    return getattr(tensor, _FORMAT_ATTR, ACL_FORMAT_ND)
