"""CPU kernels, written over plain torch ops so that the ``cuda`` backend reuses them.

* bf16: ``F.linear`` (a BF16 GEMM for BF16 activations, float32 otherwise).
* w8a8_dynamic: the numbers of ``formats.w8a8_npu.dynamic_quant_matmul`` (F32 scales), bit for bit:
  per-token int8 quantization (``dynamic_quant``), exact int32 accumulation by ``torch._int_mm``
  (available on CPU in torch 2.13), ``y = dtype_x(f32(acc) * weight_scale * x_scale)``.
* w8a8 (static): likewise ``static_quant_matmul``: ``x_q = clamp(rint(x * (1 / input_scale) +
  input_offset))``, ``torch._int_mm`` + ``quant_bias`` (tp rank 0 only), times ``deq_scale``.
  ``torch._weight_int8pack_mm`` (int8 weight x float activation) is not used: both int8 formats
  quantize the activations as well, so it would compute another (W8A16) product.
* awq_w4a16, ct_pack_quantized, int4_cpu, int4_cpu_group: ``torch._weight_int4pack_mm_for_cpu``. Its weight is
  ``(u - 8) * scale + zero`` per group, u the unsigned code: AWQ's ``(u - z) * s`` is scale ``s``,
  zero ``(8 - z) * s``; the two symmetric formats (code = q + 8) have zero 0; int4_cpu's per-row
  scale is repeated over groups of at most 256. Scale and zero are held in the activation dtype:
  exact for float32, rounded for BF16 / FP16 (the tests' bound covers it). It needs out % 16 == 0
  and a group of 32/64/128/256 dividing the format's group; otherwise, and for nvfp4 /
  nvfp4_ascend, the weight is dequantized once with the format's own ``dequantize`` (F32) and
  multiplied in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError, WeightFormat
from hetquant.formats.awq_w4a16 import AWQ_ORDER
from hetquant.formats.bits import unpack_nibbles_i32, unpack_nibbles_u8
from hetquant.formats.w8a8_npu import dynamic_quant

from ..registry import (
    FLOAT_DTYPES,
    Backend,
    Kernel,
    checked_shape,
    register_backend,
    register_kernel,
)

__all__ = [
    "INT4_AFFINE",
    "Int4Affine",
    "bf16_kernel",
    "cpu_int_mm",
    "dequant_kernel",
    "regroup",
    "w8a8_dynamic_kernel",
    "w8a8_static_kernel",
]

IntMM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(x_q I8 [M, K], weight I8 [N, K]) -> exact I32 [M, N]."""
INT8_MIN, INT8_MAX = -128, 127
MAX_K = 65535  # int32 accumulation (plus static quant_bias) provably exact up to here
TINYGEMM_GROUPS = (256, 128, 64, 32)


@register_backend("cpu")
def _cpu(tp_rank: int, npu_ops: Any) -> Backend:
    return Backend("cpu", torch.device("cpu"), tp_rank=tp_rank)


def cpu_int_mm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(x_q, weight.t())  # (M, N) I32


def bf16_kernel(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    n, k = checked_shape(fmt, tensors)
    w = tensors["weight"].to(ctx.device).contiguous()  # (N, K) BF16

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == w.dtype:
            return F.linear(x, w)
        return F.linear(x.float(), w.float()).to(x.dtype)

    return Kernel(fn, k, n, "F.linear (BF16 GEMM for BF16 x, else float32)", {"weight": w})


register_kernel("bf16", "cpu", "cuda", "npu")(bf16_kernel)


def dequant_kernel(
    fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend, why: str = ""
) -> Kernel:
    """The fallback: ``fmt.dequantize`` once (F32 [N, K], the format's definition), F32 GEMM.
    The dequantization runs on the host (the formats' reference code), whatever ``ctx.device``."""
    n, k = checked_shape(fmt, tensors)
    host = {key: t.cpu() for key, t in tensors.items()}
    w = fmt.dequantize(host).to(ctx.device, torch.float32)  # (N, K)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), w).to(x.dtype)

    uses = "dequantize once (F32) + F.linear in float32" + (f" [{why}]" if why else "")
    return Kernel(fn, k, n, uses, {"weight": w})


register_kernel("nvfp4", "cpu", "cuda")(dequant_kernel)
register_kernel("nvfp4_ascend", "cpu", "cuda")(dequant_kernel)


def _int8_weight(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend):
    n, k = checked_shape(fmt, tensors)
    if k > MAX_K:
        raise HetquantError(
            f"{fmt.name}: in_features {k} > {MAX_K}; int32 accumulation could overflow"
        )
    if bool(tensors["weight_offset"].any()):
        raise HetquantError(
            f"{fmt.name}: weight_offset is not all zero; only symmetric int8 weights are "
            "supported (what msModelSlim writes and npu_quant_matmul computes)"
        )
    return n, k, tensors["weight"].to(ctx.device).contiguous()  # (N, K) I8


def w8a8_dynamic_kernel(int_mm: IntMM, name: str) -> Callable[..., Kernel]:
    def prepare(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
        n, k, w = _int8_weight(fmt, tensors, ctx)
        s = tensors["weight_scale"].reshape(-1).to(ctx.device, torch.float32)  # (N,)

        def fn(x: torch.Tensor) -> torch.Tensor:
            x_q, x_scale = dynamic_quant(x)  # (M, K) I8, (M,) F32
            acc = int_mm(x_q, w).to(torch.float32)  # (M, N)
            return (acc * s * x_scale.unsqueeze(-1)).to(x.dtype)

        uses = f"per-token int8 quantization + {name} (exact int32) + F32 scales"
        return Kernel(fn, k, n, uses, {"weight": w, "weight_scale": s})

    return prepare


def w8a8_static_kernel(int_mm: IntMM, name: str) -> Callable[..., Kernel]:
    def prepare(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
        n, k, w = _int8_weight(fmt, tensors, ctx)
        dev = ctx.device
        recip = 1.0 / tensors["input_scale"].reshape(1).to(dev, torch.float32)  # (1,)
        offset = tensors["input_offset"].reshape(1).to(dev, torch.float32)  # (1,)
        deq = tensors["deq_scale"].to(dev, torch.float32)  # (N,)
        bias = tensors["quant_bias"].to(dev) if ctx.tp_rank == 0 else None  # (N,) I32

        def fn(x: torch.Tensor) -> torch.Tensor:
            if not bool(torch.isfinite(x).all()):
                raise HetquantError(f"{fmt.name}: activations contain NaN/Inf")
            x_q = torch.round(x.float() * recip + offset).clamp(INT8_MIN, INT8_MAX)  # (M, K)
            acc = int_mm(x_q.to(torch.int8), w)  # (M, N) I32
            if bias is not None:
                acc = acc + bias
            return (acc.to(torch.float32) * deq).to(x.dtype)

        uses = f"static int8 quantization + {name} (exact int32) + quant_bias + deq_scale"
        prepared = {"weight": w, "deq_scale": deq} | (
            {"quant_bias": bias} if bias is not None else {}
        )
        return Kernel(fn, k, n, uses, prepared)

    return prepare


register_kernel("w8a8_dynamic", "cpu")(w8a8_dynamic_kernel(cpu_int_mm, "torch._int_mm"))
register_kernel("w8a8", "cpu")(w8a8_static_kernel(cpu_int_mm, "torch._int_mm"))


@dataclass(frozen=True)
class Int4Affine:
    """``W[n, k] = (codes[n, k] - 8) * scale[k // group, n] + zero[k // group, n]`` (tinygemm)."""

    codes: torch.Tensor  # U8 [N, K], 0..15
    scale: torch.Tensor  # F32 [K / group, N]
    zero: torch.Tensor  # F32 [K / group, N]
    group: int


def _awq_affine(fmt: Any, t: Mapping[str, torch.Tensor]) -> Int4Affine:
    codes = unpack_nibbles_i32(t["qweight"], AWQ_ORDER).T.contiguous()  # (N, K)
    z = unpack_nibbles_i32(t["qzeros"], AWQ_ORDER).to(torch.float32)  # (K/g, N)
    s = t["scales"].to(torch.float32)  # (K/g, N)
    return Int4Affine(codes, s, (8 - z) * s, fmt.group_size)  # (8 - z) * s exact in F32


def _ct_affine(fmt: Any, t: Mapping[str, torch.Tensor]) -> Int4Affine:
    s = t["weight_scale"].to(torch.float32).T.contiguous()  # (K/g, N)
    return Int4Affine(
        unpack_nibbles_i32(t["weight_packed"]), s, torch.zeros_like(s), fmt.group_size
    )


def _int4_cpu_affine(fmt: Any, t: Mapping[str, torch.Tensor]) -> Int4Affine:
    codes = unpack_nibbles_u8(t["weight_packed"])  # (N, K), q + 8
    s = t["weight_scale"].to(torch.float32)[None, :]  # (1, N): one group spans the row
    return Int4Affine(codes, s, torch.zeros_like(s), codes.shape[1])


def _int4_cpu_group_affine(fmt: Any, t: Mapping[str, torch.Tensor]) -> Int4Affine:
    s = t["weight_scale"].to(torch.float32).T.contiguous()  # (K/g, N)
    codes = unpack_nibbles_u8(t["weight_packed"])  # (N, K), q + 8
    return Int4Affine(codes, s, torch.zeros_like(s), fmt.group_size)


INT4_AFFINE: dict[str, Callable[[Any, Mapping[str, torch.Tensor]], Int4Affine]] = {
    "awq_w4a16": _awq_affine,
    "ct_pack_quantized": _ct_affine,
    "int4_cpu": _int4_cpu_affine,
    "int4_cpu_group": _int4_cpu_group_affine,
}
"""format name → its weights in tinygemm's ``(u - 8) * scale + zero`` form."""


def regroup(aff: Int4Affine) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(g, scale, zero) with g the largest tinygemm group dividing ``aff.group``; or None."""
    for g in TINYGEMM_GROUPS:
        if aff.group % g == 0:
            r = aff.group // g
            return g, aff.scale.repeat_interleave(r, 0), aff.zero.repeat_interleave(r, 0)
    return None


def _int4_cpu_kernel(
    fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend
) -> Kernel:
    n, k = checked_shape(fmt, tensors)
    aff = INT4_AFFINE[fmt.name](fmt, tensors)
    grouped = regroup(aff)
    if grouped is None or n % 16:
        why = f"_weight_int4pack_mm_for_cpu needs out % 16 == 0 and group % 32 == 0; out={n}"
        return dequant_kernel(fmt, tensors, ctx, why=f"{why}, group={aff.group}")
    g, scale, zero = grouped
    packed = torch._convert_weight_to_int4pack_for_cpu(aff.codes.to(torch.int32), 1)
    sz = torch.stack([scale, zero], dim=-1)  # (K/g, N, 2) F32
    by_dtype = {d: sz.to(d).contiguous() for d in FLOAT_DTYPES}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, g, by_dtype[x.dtype])

    uses = f"torch._weight_int4pack_mm_for_cpu (group {g}; scale and zero in x.dtype)"
    return Kernel(fn, k, n, uses, {"weight": packed, "scale_and_zeros": sz})


for _name in INT4_AFFINE:
    register_kernel(_name, "cpu")(_int4_cpu_kernel)
