"""npu kernels: torch_npu operator calls made the way vllm-ascend, sglang and chitu make them.

Not run on Ascend hardware. The calls follow torch_npu's documented op contracts
(reference/ascend_formats.md §3 and §2.5, Ascend/op-plugin ``docs/context``) and are tested against
``runtime.npu_emulation``, a CPU emulation of exactly those documented semantics (shapes, dtypes,
formulas). What each format prepares once and calls per forward:

* w8a8_dynamic (vllm-ascend ``w8a8_dynamic.py``): ``weight.T.contiguous()`` -> [K, N] int8, then
  ``npu_format_cast(w, 29)`` (FRACTAL_NZ); ``weight_scale`` flattened to [N] and held in BF16 (a
  BF16 model's params dtype) and F32 (``weight_scale_fp32``). Forward:
  ``x_q, pertoken = npu_dynamic_quant(x)``, ``npu_quant_matmul(x_q, w, scale,
  pertoken_scale=pertoken, output_dtype=x.dtype)``, the BF16 scale for BF16 x and the F32 one for
  FP16 x (the op's FP16-output row takes an F32 scale only). Numbers:
  ``dynamic_quant_matmul(x, t, param_dtype=torch.bfloat16)`` for BF16 x, ``param_dtype=None`` for FP16.
* w8a8 (vllm-ascend ``w8a8_static.py``): ``input_scale`` held in the activation dtype, repeated to
  K and inverted (``aclnn_input_scale_reciprocal``); ``input_offset`` (an int8 parameter) repeated
  to K and cast to that dtype; weight as above; ``deq_scale`` F32 [N]; ``quant_bias`` int32 [N],
  passed on tp rank 0 only. Forward: ``npu_quantize(x, recip, offset, torch.qint8, -1, False)``,
  ``npu_quant_matmul(x_q, w, deq_scale, bias=quant_bias, output_dtype=x.dtype)``. Numbers:
  ``static_quant_matmul(x, t, param_dtype=x.dtype)``.
  Both int8 kernels split N into parts of at most 65535 columns (the op's last-dim limit; vllm-ascend
  splits ``q_b_proj`` likewise) and refuse K > 65535. They refuse a non-zero ``weight_offset``.
* awq_w4a16 (sglang ``AWQLinearAscendMethod``): :func:`awq_to_int4pack` puts each qweight word's
  nibbles in logical order (element i read at shift ``4 * AWQ_REVERSE_ORDER[i]``, written to nibble
  i) and XORs 0x88888888, turning unsigned u into the two's-complement nibble u - 8: torch_npu's
  int4pack words, element j in bits 4j..4j+3. qzeros are unpacked the same way and
  ``antiquant_offset = 8 - z`` in the scale dtype. Forward: ``npu_weight_quant_batchmatmul(x,
  qweight [K, N/8], antiquant_scale=scales [K/g, N], antiquant_offset=offset,
  antiquant_group_size=g)``, i.e. ``(u - 8 + 8 - z) * s``.
* ct_pack_quantized: vllm-ascend's W4A16 repack (of its MoE method; it has no W4A16 linear):
  unpack, subtract 8, transpose to [K, N], ``npu_convert_weight_to_int4pack`` -> [K, N/8]; scales
  transposed to [K/g, N]; then ``npu_weight_quant_batchmatmul`` with no offset (symmetric).
  For both int4 formats scale and offset are cast to the activation dtype (the op requires it);
  when in == group, group size 0 with the (1, N) scale selects the op's per-channel mode.
* nvfp4, nvfp4_ascend (chitu, ``npu_fusion_fp4``): Ascend's vector units have no FP4 type, so
  chitu's kernel converts E2M1 -> BF16 with shifts and one multiply and applies the folded BF16
  group scale (``npu_scale_bf16``: bf16(e4m3 * weight_scale_2)) inside its GEMM. That kernel
  (cinfer_ascendc) is not available here: the same conversion (``e2m1_to_bf16_soft``) and fold run
  once at load, ``W = bf16(f32(e2m1) * f32(scale))`` as the kernel rounds, then a BF16
  ``torch.matmul``. BF16 activations only (chitu requires ``raise_lower_bit_float_to=bfloat16``);
  the weight costs BF16 memory, 4x the FP4 bytes.
* bf16: F.linear. int4_cpu, int4_cpu_group: refused, they are the CPU expert pool's formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import torch

from hetquant.formats import HetquantError, WeightFormat
from hetquant.formats.awq_w4a16 import AWQ_ORDER, AWQ_REVERSE_ORDER
from hetquant.formats.bits import unpack_nibbles_i32, unpack_nibbles_u8
from hetquant.formats.nvfp4 import BLOCK
from hetquant.formats.nvfp4_ascend import e2m1_to_bf16_soft, npu_scale_bf16, to_canonical

from ..registry import Backend, Kernel, checked_shape, register_backend, register_kernel

__all__ = ["ACL_FORMAT_FRACTAL_NZ", "NPU_MAX_DIM", "awq_to_int4pack", "column_parts"]

ACL_FORMAT_FRACTAL_NZ = 29  # vllm-ascend utils.py
NPU_MAX_DIM = 65535  # npu_quant_matmul: last dims of x1, x2; WQBMM: K and N
_ACT = (torch.bfloat16, torch.float16)


@register_backend("npu")
def _npu(tp_rank: int, npu_ops: Any) -> Backend:
    ops = npu_ops
    if ops is None:
        try:
            import torch_npu as ops
        except (ImportError, OSError, RuntimeError) as exc:
            raise HetquantError(
                f"backend 'npu' needs torch_npu on an Ascend host ({type(exc).__name__}: {exc}); "
                "to run the npu code path on CPU against an emulation of torch_npu's documented "
                "ops, pass npu_ops=hetquant.runtime.kernels.npu_emulation"
            ) from None
    device = getattr(ops, "EMULATION_DEVICE", None) or torch.device("npu")
    return Backend("npu", torch.device(device), ops, tp_rank)


def _limit(fmt: WeightFormat, what: str, size: int) -> None:
    if size > NPU_MAX_DIM:
        raise HetquantError(
            f"{fmt.name} on npu: {what} = {size} > {NPU_MAX_DIM}, the torch_npu op's limit"
        )


def column_parts(n: int) -> list[slice]:
    """The fewest near-equal column ranges of [0, n), each at most NPU_MAX_DIM wide."""
    p = -(-n // NPU_MAX_DIM)
    edges = [i * n // p for i in range(p + 1)]
    return [slice(a, b) for a, b in pairwise(edges)]


def _parts_named(name: str, ts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: ts[0]} if len(ts) == 1 else {f"{name}.{i}": t for i, t in enumerate(ts)}


def _nz_int8_parts(fmt, tensors, ctx) -> tuple[int, int, list[slice], list[torch.Tensor]]:
    n, k = checked_shape(fmt, tensors)
    _limit(fmt, "in_features (k)", k)
    if bool(tensors["weight_offset"].any()):
        raise HetquantError(
            f"{fmt.name}: weight_offset is not all zero; npu_quant_matmul is symmetric"
        )
    parts = column_parts(n)
    w_kn = tensors["weight"].T.contiguous()  # (K, N)
    nz = [
        ctx.ops.npu_format_cast(w_kn[:, p].contiguous().to(ctx.device), ACL_FORMAT_FRACTAL_NZ)
        for p in parts
    ]
    return n, k, parts, nz


@register_kernel("w8a8_dynamic", "npu")
def _w8a8_dynamic(fmt: WeightFormat, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    n, k, parts, ws = _nz_int8_parts(fmt, t, ctx)
    ops, scale = ctx.ops, t["weight_scale"].reshape(-1)  # (N,)
    scales = {
        torch.bfloat16: [scale[p].to(ctx.device, torch.bfloat16) for p in parts],
        torch.float16: [scale[p].to(ctx.device, torch.float32) for p in parts],
    }

    def fn(x: torch.Tensor) -> torch.Tensor:
        x_q, pertoken = ops.npu_dynamic_quant(x)
        ys = [
            ops.npu_quant_matmul(x_q, w, s, pertoken_scale=pertoken, output_dtype=x.dtype)
            for w, s in zip(ws, scales[x.dtype], strict=True)
        ]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    prepared = _parts_named("weight", ws) | {
        "weight_scale": torch.cat(scales[torch.bfloat16]),
        "weight_scale_fp32": torch.cat(scales[torch.float16]),
    }
    uses = f"npu_dynamic_quant + npu_quant_matmul (W8A8_DYNAMIC, NZ weight, {len(ws)} part(s))"
    return Kernel(fn, k, n, uses, prepared, _ACT)


@register_kernel("w8a8", "npu")
def _w8a8_static(fmt: WeightFormat, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    n, k, parts, ws = _nz_int8_parts(fmt, t, ctx)
    ops, dev = ctx.ops, ctx.device
    recip, offset = {}, {}
    for d in _ACT:
        input_scale = t["input_scale"].reshape(1).to(d)  # a params_dtype parameter
        recip[d] = (1 / input_scale.repeat(k)).to(dev)  # aclnn_input_scale_reciprocal (K,)
        in_offset = t["input_offset"].reshape(1).to(torch.int8)  # an int8 parameter
        offset[d] = in_offset.repeat(k).to(dev, d)  # aclnn_input_offset (K,)
    deq = [t["deq_scale"][p].to(dev, torch.float32) for p in parts]
    bias = [t["quant_bias"][p].to(dev) if ctx.tp_rank == 0 else None for p in parts]

    def fn(x: torch.Tensor) -> torch.Tensor:
        x_q = ops.npu_quantize(x, recip[x.dtype], offset[x.dtype], torch.qint8, -1, False)
        ys = [
            ops.npu_quant_matmul(x_q, w, s, bias=b, output_dtype=x.dtype)
            for w, s, b in zip(ws, deq, bias, strict=True)
        ]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    prepared = _parts_named("weight", ws) | {"deq_scale": torch.cat(deq)}
    if ctx.tp_rank == 0:
        prepared["quant_bias"] = torch.cat(bias)
    uses = f"npu_quantize + npu_quant_matmul (static W8A8, NZ weight, {len(ws)} part(s))"
    return Kernel(fn, k, n, uses, prepared, _ACT)


def awq_to_int4pack(qweight: torch.Tensor) -> torch.Tensor:
    """sglang's AWQ repack: AutoAWQ words (unsigned, AWQ_ORDER) -> torch_npu int4pack words.

    Logical element i (read at bits ``4 * AWQ_REVERSE_ORDER[i]``) goes to nibble i; XOR with
    0x88888888 maps each unsigned u in 0..15 to the 4-bit two's complement of u - 8.
    """
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for i, src in enumerate(AWQ_REVERSE_ORDER):
        out |= ((w >> (4 * src)) & 0xF) << (4 * i)
    out ^= 0x88888888
    return (out - ((out >> 31) << 32)).to(torch.int32)  # as signed int32


def _wqbmm(ctx: Backend, w, scale, offset, group: int, k: int, n: int, uses: str) -> Kernel:
    ops = ctx.ops
    group_arg = group if k > group else 0  # one group over K is the per-channel mode
    scales = {d: scale.to(ctx.device, d) for d in _ACT}
    offsets = {d: None if offset is None else offset.to(ctx.device, d) for d in _ACT}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return ops.npu_weight_quant_batchmatmul(
            x,
            w,
            antiquant_scale=scales[x.dtype],
            antiquant_offset=offsets[x.dtype],
            antiquant_group_size=group_arg,
        )

    prepared = {"weight": w, "antiquant_scale": scales[torch.bfloat16]}
    if offset is not None:
        prepared["antiquant_offset"] = offsets[torch.bfloat16]
    return Kernel(fn, k, n, uses, prepared, _ACT)


@register_kernel("awq_w4a16", "npu")
def _awq(fmt: Any, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    n, k = checked_shape(fmt, t)
    _limit(fmt, "in_features", k)
    _limit(fmt, "out_features", n)
    w = awq_to_int4pack(t["qweight"]).to(ctx.device)  # (K, N/8)
    z = unpack_nibbles_i32(t["qzeros"], AWQ_ORDER).to(torch.int32)  # (K/g, N)
    offset = (8 - z).to(t["scales"].dtype)  # sglang: -(z - 8), in the scale dtype
    uses = (
        "sglang AWQ repack (reorder, XOR 0x88888888, offset 8 - z) + npu_weight_quant_batchmatmul"
    )
    return _wqbmm(ctx, w, t["scales"], offset, fmt.group_size, k, n, uses)


@register_kernel("ct_pack_quantized", "npu")
def _ct(fmt: Any, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    n, k = checked_shape(fmt, t)
    _limit(fmt, "in_features", k)
    _limit(fmt, "out_features", n)
    if n % 8:
        raise HetquantError(
            f"{fmt.name} on npu: out_features {n} must be a multiple of 8 (int4pack)"
        )
    q = unpack_nibbles_i32(t["weight_packed"]).to(torch.int32) - 8  # (N, K) signed
    w = ctx.ops.npu_convert_weight_to_int4pack(q.T.contiguous().to(ctx.device))  # (K, N/8)
    scale = t["weight_scale"].T.contiguous()  # (K/g, N)
    uses = (
        "npu_convert_weight_to_int4pack (vllm-ascend W4A16 repack) + npu_weight_quant_batchmatmul"
    )
    return _wqbmm(ctx, w, scale, None, fmt.group_size, k, n, uses)


def _cpu_pool_only(fmt: WeightFormat, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    raise HetquantError(
        f"{fmt.name} is the CPU expert pool's format (routed experts computed by the host CPU); "
        "it has no NPU kernel. Load it with backend='cpu', or convert the experts with an NPU "
        "recipe (ascend-w8a8)"
    )


for _name in ("int4_cpu", "int4_cpu_group"):
    register_kernel(_name, "npu")(_cpu_pool_only)


def _soft_fp4(canonical: Mapping[str, torch.Tensor], n: int, k: int, ctx: Backend) -> Kernel:
    values = e2m1_to_bf16_soft(unpack_nibbles_u8(canonical["weight"])).float()  # (N, K) exact
    scale = npu_scale_bf16(canonical)  # (N, K/16) BF16: bf16(e4m3 * weight_scale_2)
    w = values * scale.float().repeat_interleave(BLOCK, dim=1)  # (N, K), exact in F32
    w_kn = w.to(torch.bfloat16).T.contiguous().to(ctx.device)  # one BF16 rounding, as the kernel

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, w_kn)

    uses = "soft FP4 at load (e2m1_to_bf16_soft x npu_scale_bf16 -> BF16, as chitu) + BF16 matmul"
    return Kernel(fn, k, n, uses, {"weight": w_kn, "weight_scale": scale}, (torch.bfloat16,))


@register_kernel("nvfp4", "npu")
def _nvfp4(fmt: WeightFormat, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    return _soft_fp4(t, *checked_shape(fmt, t), ctx)


@register_kernel("nvfp4_ascend", "npu")
def _nvfp4_ascend(fmt: WeightFormat, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    return _soft_fp4(to_canonical(t), *checked_shape(fmt, t), ctx)
