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
"""

from __future__ import annotations

import math

import torch

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
MAX_DIM = 65535
INT8_MAX = 127
_HALF = (torch.float16, torch.bfloat16)
_FORMAT_ATTR = "_hetquant_npu_format"


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t.float()).all()):
        raise NotImplementedError(f"{name} contains NaN/Inf: the documentation defines no result")


def npu_dynamic_quant(
    x: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x.dtype in _HALF, f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype}")
    _check(x.dim() > 1, f"npu_dynamic_quant: x must have more than 1 dim, got {x.dim()}")
    if group_index is not None:
        raise NotImplementedError("npu_dynamic_quant: group_index (MoE) is not emulated")
    if dst_type == torch.quint4x2:
        raise NotImplementedError("npu_dynamic_quant: dst_type quint4x2 is not emulated")
    _check(dst_type in (None, torch.int8), f"npu_dynamic_quant: dst_type {dst_type} unsupported")
    _finite("npu_dynamic_quant: x", x)
    xf = x.to(torch.float32)
    if smooth_scales is not None:
        _check(smooth_scales.dtype in _HALF, "npu_dynamic_quant: smooth_scales must be fp16/bf16")
        _check(
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
    _check(
        dtype == torch.qint8, f"npu_quantize: with div_mode=False dtype must be qint8, got {dtype}"
    )
    floats = (torch.float32, *_HALF)
    _check(input.dtype in floats, f"npu_quantize: input dtype {input.dtype} unsupported")
    _check(scales.dtype in floats, f"npu_quantize: scales dtype {scales.dtype} unsupported")
    _check(-2 <= axis < input.dim(), f"npu_quantize: axis {axis} outside [-2, {input.dim() - 1}]")
    ax = input.dim() - 2 if axis == -2 else input.dim() - 1
    size = input.shape[ax]
    if scales.dim() == 1:
        _check(scales.shape[0] in (1, size), f"npu_quantize: scales size must be 1 or {size}")
        shape = [scales.shape[0]] + [1] * (input.dim() - 1 - ax)
    else:
        ok = scales.dim() == input.dim() and all(
            s == 1 or (d == ax and s == size) for d, s in enumerate(scales.shape)
        )
        _check(ok, f"npu_quantize: scales shape {tuple(scales.shape)} does not fit input axis {ax}")
        shape = list(scales.shape)
    if zero_points is not None:
        _check(
            zero_points.shape == scales.shape and zero_points.dtype == scales.dtype,
            "npu_quantize: zero_points must have the shape and dtype of scales",
        )
    _finite("npu_quantize: input", input)
    y = input.to(torch.float32) * scales.to(torch.float32).reshape(shape)
    if zero_points is not None:
        y = y + zero_points.to(torch.float32).reshape(shape)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
    group_sizes: list[int] | None = None,
) -> torch.Tensor:
    _check(x1.dtype == x2.dtype, f"npu_quant_matmul: x1 {x1.dtype} and x2 {x2.dtype} differ")
    if x1.dtype == torch.int32:
        raise NotImplementedError("npu_quant_matmul: int4 (int32-packed) inputs are not emulated")
    _check(x1.dtype == torch.int8, f"npu_quant_matmul: x1/x2 must be int8, got {x1.dtype}")
    _check(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "npu_quant_matmul: x1, x2 need 2-6 dims")
    _check(
        x1.shape[-1] <= MAX_DIM and x2.shape[-1] <= MAX_DIM,
        f"npu_quant_matmul: last dims of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must not "
        f"exceed {MAX_DIM}",
    )
    k, n = x1.shape[-1], x2.shape[-1]
    _check(x2.shape[-2] == k, f"npu_quant_matmul: x1 k={k} != x2 k={x2.shape[-2]}")
    _check(x1.numel() > 0 and x2.numel() > 0, "npu_quant_matmul: x1, x2 must not be empty")
    if group_sizes is not None:
        raise NotImplementedError("npu_quant_matmul: group_sizes is not emulated")
    _check(
        scale.dim() == 1 and scale.shape[0] in (1, n),
        f"npu_quant_matmul: scale must be (1,) or ({n},)",
    )
    if scale.dtype == torch.int64:
        raise NotImplementedError("npu_quant_matmul: int64 (npu_trans_quant_param) scale")
    out = torch.int8 if output_dtype is None else output_dtype
    if out in (torch.int8, torch.int32):
        raise NotImplementedError(f"npu_quant_matmul: {out} output is not emulated")
    # Table 2 (Atlas A2/A3) rows with a float output, int8 inputs, offset None:
    if out == torch.bfloat16:
        scales, biases, pertokens = (
            (torch.float32, torch.bfloat16),
            _BIAS_ANY,
            (None, torch.float32),
        )
    elif out == torch.float16:
        scales, pertokens = (torch.float32,), (None, torch.float32)
        biases = (None, torch.int32) if pertoken_scale is None else _BIAS_ANY
    else:
        raise RuntimeError(f"npu_quant_matmul: output_dtype {out} unsupported")
    _check(offset is None, f"npu_quant_matmul: offset must be None for {out} output")
    _check(scale.dtype in scales, f"npu_quant_matmul: scale {scale.dtype} invalid for {out} output")
    _check(_dt(bias) in biases, f"npu_quant_matmul: bias {_dt(bias)} invalid here ({out} output)")
    _check(
        _dt(pertoken_scale) in pertokens,
        f"npu_quant_matmul: pertoken_scale {_dt(pertoken_scale)} invalid",
    )
    m = x1.shape[-2]
    if pertoken_scale is not None:
        _check(
            tuple(pertoken_scale.shape) == (m,), f"npu_quant_matmul: pertoken_scale must be ({m},)"
        )
    out_dim = max(x1.dim(), x2.dim())
    if bias is not None:
        ok = tuple(bias.shape) == (n,) or (
            out_dim == 3 and bias.dim() == 3 and bias.shape[1:] == (1, n)
        )
        _check(ok, f"npu_quant_matmul: bias must be ({n},) (or (batch, 1, {n}) for 3-D output)")
    acc = torch.matmul(x1.to(torch.int64), x2.to(torch.int64))  # exact
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    if acc.numel() and int(acc.abs().max()) > 2**31 - 1:
        raise NotImplementedError("npu_quant_matmul: int32 accumulator overflow")
    y = acc.to(torch.float32) * scale.to(torch.float32)
    if pertoken_scale is not None:
        y = y * pertoken_scale.unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.to(torch.float32)
    return y.to(out)


_BIAS_ANY = (None, torch.int32, torch.bfloat16, torch.float32)


def _dt(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [.., c] (int4pack) -> int64 [.., 8c] signed, element j of a word from bits 4j.."""
    nib = (words.to(torch.int64)[..., None] >> torch.arange(0, 32, 4)) & 0xF
    return (nib - ((nib & 0x8) << 1)).reshape(*words.shape[:-1], -1)


def npu_weight_quant_batchmatmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
) -> torch.Tensor:
    w_name = "npu_weight_quant_batchmatmul"
    _check(x.dtype in _HALF, f"{w_name}: x must be float16 or bfloat16, got {x.dtype}")
    _check(x.dim() == 2 and weight.dim() == 2, f"{w_name}: x (M, K) and weight (K, N) must be 2-D")
    _check(weight.dtype in (torch.int8, torch.int32), f"{w_name}: weight must be int8 or int32")
    _check(x.numel() > 0 and weight.numel() > 0, f"{w_name}: empty tensors are not supported")
    k = x.shape[1]
    n = weight.shape[1] * (8 if weight.dtype == torch.int32 else 1)
    _check(weight.shape[0] == k, f"{w_name}: x K={k} != weight K={weight.shape[0]}")
    _check(k <= MAX_DIM and n <= MAX_DIM, f"{w_name}: K={k}, N={n} must lie in [1, {MAX_DIM}]")
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(f"{w_name}: quant_scale / quant_offset are not emulated")
    if antiquant_scale.dtype == torch.int64:
        raise NotImplementedError(f"{w_name}: int64 antiquant_scale is not emulated")
    _check(
        antiquant_scale.dtype == x.dtype, f"{w_name}: antiquant_scale must have x's dtype {x.dtype}"
    )
    g = antiquant_group_size
    _check(
        g == 0 or (g % 32 == 0 and 32 <= g <= k - 1),
        f"{w_name}: antiquant_group_size {g} must be 0 or a multiple of 32 in [32, K-1={k - 1}]",
    )
    shape = tuple(antiquant_scale.shape)
    if g:
        _check(
            shape == (math.ceil(k / g), n),
            f"{w_name}: per-group scale must be ({math.ceil(k / g)}, {n})",
        )
    else:
        _check(shape in ((1,), (1, 1), (n,), (1, n)), f"{w_name}: scale shape {shape} invalid")
    if antiquant_offset is not None:
        _check(
            tuple(antiquant_offset.shape) == shape
            and antiquant_offset.dtype == antiquant_scale.dtype,
            f"{w_name}: antiquant_offset must have antiquant_scale's shape and dtype",
        )
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        _check(bias.dtype == want, f"{w_name}: bias must be {want} for {x.dtype} x")
        _check(tuple(bias.shape) in ((n,), (1, n)), f"{w_name}: bias must be ({n},) or (1, {n})")
    _check(inner_precise in (0, 1), f"{w_name}: inner_precise must be 0 or 1")
    _finite(f"{w_name}: x", x)
    w = (_unpack_int4(weight) if weight.dtype == torch.int32 else weight).to(torch.float32)
    s = antiquant_scale.to(torch.float32).reshape(-1, n if shape[-1] == n else 1)
    off = None if antiquant_offset is None else antiquant_offset.to(torch.float32).reshape(s.shape)
    if g:
        s = s.repeat_interleave(g, dim=0)[:k]
        off = None if off is None else off.repeat_interleave(g, dim=0)[:k]
    w = ((w if off is None else w + off) * s).to(x.dtype)  # (K, N), the antiquantized weight
    y = x.to(torch.float32) @ w.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32).reshape(1, n)
    return y.to(x.dtype)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    name = "npu_convert_weight_to_int4pack"
    if weight.dtype == torch.float32:
        raise NotImplementedError(f"{name}: float32 (FP4) input is not emulated")
    _check(weight.dtype == torch.int32, f"{name}: weight must be int32, got {weight.dtype}")
    _check(weight.is_contiguous(), f"{name}: weight should be contiguous")
    _check(weight.dim() == 2, f"{name}: weight must be 2-D (k, n) or (n, k), got {weight.dim()}-D")
    _check(min(weight.shape) > 0, f"{name}: weight dim should be greater than 0")
    _check(weight.shape[-1] % 8 == 0, f"{name}: weight last dim should be a multiple of 8")
    _check(
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
