"""CUDA kernels: the CPU kernels' numbers on CUDA tensors, with CUDA's integer kernels where they fit.

* w8a8_dynamic, w8a8: ``torch._int_mm`` (int8 x int8 -> int32) when in % 8 == 0 and out % 8 == 0,
  rows zero-padded to 17 (it needs M > 16); otherwise an exact float64 matmul (every partial sum is
  an integer below 2^31 < 2^53). Same numbers as the CPU kernels.
* awq_w4a16, ct_pack_quantized, int4_cpu: ``torch._weight_int4pack_mm`` (tinygemm; sm80 or newer;
  BF16 only, so activations are rounded to BF16 and the result cast back; scale and zero in BF16)
  when out % 8 == 0 and in % 32 == 0; the weight goes in as uint8 [N, K/2] with the even k in the
  high nibble (``_convert_weight_to_int4pack``). Otherwise dequantize once.
* nvfp4, nvfp4_ascend: dequantize once (F32) + F.linear. bf16: F.linear.

Constructing a cuda kernel where torch sees no CUDA device raises HetquantError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hetquant.formats import HetquantError, WeightFormat

from ..registry import Backend, Kernel, checked_shape, register_backend, register_kernel
from .cpu import INT4_AFFINE, dequant_kernel, regroup, w8a8_dynamic_kernel, w8a8_static_kernel

__all__ = ["cuda_int_mm"]

_INT_MM_MIN_ROWS = 17


@register_backend("cuda")
def _cuda(tp_rank: int, npu_ops: Any) -> Backend:
    if not torch.cuda.is_available():
        raise HetquantError(
            f"backend 'cuda': torch {torch.__version__} sees no CUDA device "
            "(torch.cuda.is_available() is False); use backend='cpu' or a CUDA build on a GPU host"
        )
    return Backend("cuda", torch.device("cuda", torch.cuda.current_device()), tp_rank=tp_rank)


def cuda_int_mm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Exact I32 x_q [M, K] @ weight[N, K].T on CUDA."""
    m, k = x_q.shape
    if k % 8 == 0 and weight.shape[0] % 8 == 0:
        pad = max(0, _INT_MM_MIN_ROWS - m)
        xp = torch.cat([x_q, x_q.new_zeros(pad, k)]) if pad else x_q
        return torch._int_mm(xp, weight.t())[:m]
    return (x_q.double() @ weight.double().t()).to(torch.int32)


register_kernel("w8a8_dynamic", "cuda")(w8a8_dynamic_kernel(cuda_int_mm, "torch._int_mm"))
register_kernel("w8a8", "cuda")(w8a8_static_kernel(cuda_int_mm, "torch._int_mm"))


def _int4_cuda_kernel(
    fmt: WeightFormat, tensors: Mapping[str, torch.Tensor], ctx: Backend
) -> Kernel:
    n, k = checked_shape(fmt, tensors)
    tensors = {key: t.cpu() for key, t in tensors.items()}  # unpacked once, on the host
    aff = INT4_AFFINE[fmt.name](fmt, tensors)
    grouped = regroup(aff)
    inner = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
    if torch.cuda.get_device_capability(ctx.device) < (8, 0):
        return dequant_kernel(fmt, tensors, ctx, why="tinygemm needs sm80 or newer")
    if grouped is None or inner is None or n % 8:
        why = "_weight_int4pack_mm needs out % 8 == 0, in % 32 == 0, group % 32 == 0"
        return dequant_kernel(fmt, tensors, ctx, why=f"{why}; out={n}, in={k}, group={aff.group}")
    g, scale, zero = grouped
    c = aff.codes  # (N, K) U8
    u8 = ((c[:, 0::2] << 4) | c[:, 1::2]).contiguous().to(ctx.device)  # (N, K/2), even k high
    packed = torch._convert_weight_to_int4pack(u8, inner)
    sz = torch.stack([scale, zero], dim=-1).to(ctx.device, torch.bfloat16).contiguous()

    def fn(x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        return torch._weight_int4pack_mm(xb, packed, g, sz).to(x.dtype)

    uses = f"torch._weight_int4pack_mm (tinygemm, BF16, group {g}, inner_k_tiles {inner})"
    return Kernel(fn, k, n, uses, {"weight": packed, "scale_and_zeros": sz})


for _name in INT4_AFFINE:
    register_kernel(_name, "cuda")(_int4_cuda_kernel)
