"""The two matmuls of the CPU emulation of torch_npu: ``npu_quant_matmul`` (int8 x int8, dequantized
by per-channel and per-token scales) and ``npu_weight_quant_batchmatmul`` (fp16/bf16 activations
times an int8 or int4pack weight antiquantized on the fly).

Their documented contracts, and the numerics the emulation chooses where the documentation leaves
them open (points 3 and 4), are in ``runtime/kernels/npu_emulation.py``'s docstring; that module
re-exports both, and is the one to pass as ``npu_ops``.
"""

from __future__ import annotations

import math

import torch

from ._npu_checks import HALF, MAX_DIM, check, check_finite, dtype_of

__all__ = ["npu_quant_matmul", "npu_weight_quant_batchmatmul"]

_BIAS_ANY = (None, torch.int32, torch.bfloat16, torch.float32)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [.., c] (int4pack) -> int64 [.., 8c] signed, element j of a word from bits 4j.."""
    nib = (words.to(torch.int64)[..., None] >> torch.arange(0, 32, 4)) & 0xF
    return (nib - ((nib & 0x8) << 1)).reshape(*words.shape[:-1], -1)


def _check_dtype_table(
    out: torch.dtype,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    pertoken_scale: torch.Tensor | None,
) -> None:
    """npu_quant_matmul's dtype combinations for a float output (the doc's Table 2)."""
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
    check(offset is None, f"npu_quant_matmul: offset must be None for {out} output")
    check(scale.dtype in scales, f"npu_quant_matmul: scale {scale.dtype} invalid for {out} output")
    check(
        dtype_of(bias) in biases,
        f"npu_quant_matmul: bias {dtype_of(bias)} invalid here ({out} output)",
    )
    check(
        dtype_of(pertoken_scale) in pertokens,
        f"npu_quant_matmul: pertoken_scale {dtype_of(pertoken_scale)} invalid",
    )


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
    check(x1.dtype == x2.dtype, f"npu_quant_matmul: x1 {x1.dtype} and x2 {x2.dtype} differ")
    if x1.dtype == torch.int32:
        raise NotImplementedError("npu_quant_matmul: int4 (int32-packed) inputs are not emulated")
    check(x1.dtype == torch.int8, f"npu_quant_matmul: x1/x2 must be int8, got {x1.dtype}")
    check(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "npu_quant_matmul: x1, x2 need 2-6 dims")
    check(
        x1.shape[-1] <= MAX_DIM and x2.shape[-1] <= MAX_DIM,
        f"npu_quant_matmul: last dims of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must not "
        f"exceed {MAX_DIM}",
    )
    k, n = x1.shape[-1], x2.shape[-1]
    check(x2.shape[-2] == k, f"npu_quant_matmul: x1 k={k} != x2 k={x2.shape[-2]}")
    check(x1.numel() > 0 and x2.numel() > 0, "npu_quant_matmul: x1, x2 must not be empty")
    if group_sizes is not None:
        raise NotImplementedError("npu_quant_matmul: group_sizes is not emulated")
    check(
        scale.dim() == 1 and scale.shape[0] in (1, n),
        f"npu_quant_matmul: scale must be (1,) or ({n},)",
    )
    if scale.dtype == torch.int64:
        raise NotImplementedError("npu_quant_matmul: int64 (npu_trans_quant_param) scale")
    out = torch.int8 if output_dtype is None else output_dtype
    if out in (torch.int8, torch.int32):
        raise NotImplementedError(f"npu_quant_matmul: {out} output is not emulated")
    _check_dtype_table(out, scale, offset, bias, pertoken_scale)
    m = x1.shape[-2]
    if pertoken_scale is not None:
        check(
            tuple(pertoken_scale.shape) == (m,), f"npu_quant_matmul: pertoken_scale must be ({m},)"
        )
    out_dim = max(x1.dim(), x2.dim())
    if bias is not None:
        ok = tuple(bias.shape) == (n,) or (
            out_dim == 3 and bias.dim() == 3 and bias.shape[1:] == (1, n)
        )
        check(ok, f"npu_quant_matmul: bias must be ({n},) (or (batch, 1, {n}) for 3-D output)")
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
    check(x.dtype in HALF, f"{w_name}: x must be float16 or bfloat16, got {x.dtype}")
    check(x.dim() == 2 and weight.dim() == 2, f"{w_name}: x (M, K) and weight (K, N) must be 2-D")
    check(weight.dtype in (torch.int8, torch.int32), f"{w_name}: weight must be int8 or int32")
    check(x.numel() > 0 and weight.numel() > 0, f"{w_name}: empty tensors are not supported")
    k = x.shape[1]
    n = weight.shape[1] * (8 if weight.dtype == torch.int32 else 1)
    check(weight.shape[0] == k, f"{w_name}: x K={k} != weight K={weight.shape[0]}")
    check(k <= MAX_DIM and n <= MAX_DIM, f"{w_name}: K={k}, N={n} must lie in [1, {MAX_DIM}]")
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(f"{w_name}: quant_scale / quant_offset are not emulated")
    if antiquant_scale.dtype == torch.int64:
        raise NotImplementedError(f"{w_name}: int64 antiquant_scale is not emulated")
    check(
        antiquant_scale.dtype == x.dtype, f"{w_name}: antiquant_scale must have x's dtype {x.dtype}"
    )
    g = antiquant_group_size
    check(
        g == 0 or (g % 32 == 0 and 32 <= g <= k - 1),
        f"{w_name}: antiquant_group_size {g} must be 0 or a multiple of 32 in [32, K-1={k - 1}]",
    )
    shape = tuple(antiquant_scale.shape)
    if g:
        check(
            shape == (math.ceil(k / g), n),
            f"{w_name}: per-group scale must be ({math.ceil(k / g)}, {n})",
        )
    else:
        check(shape in ((1,), (1, 1), (n,), (1, n)), f"{w_name}: scale shape {shape} invalid")
    if antiquant_offset is not None:
        check(
            tuple(antiquant_offset.shape) == shape
            and antiquant_offset.dtype == antiquant_scale.dtype,
            f"{w_name}: antiquant_offset must have antiquant_scale's shape and dtype",
        )
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        check(bias.dtype == want, f"{w_name}: bias must be {want} for {x.dtype} x")
        check(tuple(bias.shape) in ((n,), (1, n)), f"{w_name}: bias must be ({n},) or (1, {n})")
    check(inner_precise in (0, 1), f"{w_name}: inner_precise must be 0 or 1")
    check_finite(f"{w_name}: x", x)
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
