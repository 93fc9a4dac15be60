"""w4a8_dynamic on every backend: the int4 codes widened to int8 once, then the W8A8_DYNAMIC
kernel of that backend.

W4A8_DYNAMIC computes what W8A8_DYNAMIC computes — per-token int8 activations
(``npu_dynamic_quant``), exact integer products with the weight codes, ``× weight_scale ×
x_scale`` — on codes that happen to lie in [-8, 7]. So each backend's ``w8a8_dynamic`` kernel
(``cpu``: ``torch._int_mm``; ``cuda``: the same on the GPU; ``npu``: ``npu_dynamic_quant`` +
``npu_quant_matmul`` on an NZ int8 weight) gives the W4A8 numbers bit for bit, at twice the
weight memory of the packed layout. vllm-ascend runs W4A8 experts through its fused MoE path
(``npu_grouped_matmul`` on the int4 words, with ``scale_bias``); a per-linear op of that kind is
not part of torch_npu's documented contracts, so it is not emulated here. One difference: on npu
with BF16 activations the W8A8 kernel holds ``weight_scale`` in BF16 (vllm-ascend's W8A8 parameter
dtype), where vllm-ascend's W4A8 MoE keeps the F32 bits (``methods/w4a8.py:595-601``).
``scale_bias`` is checked against the codes and scales
(:func:`hetquant.formats.w4a8_npu.check_scale_bias`), then unused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetquant.formats import get_format
from hetquant.formats.w4a8_npu import W4A8Dynamic, check_scale_bias, unpack_out_pairs

from ..registry import KERNELS, Backend, Kernel, checked_shape, register_kernel

__all__: list[str] = []


@register_kernel("w4a8_dynamic", "cpu", "cuda", "npu")
def _w4a8(fmt: W4A8Dynamic, t: Mapping[str, torch.Tensor], ctx: Backend) -> Kernel:
    checked_shape(fmt, t)
    host = {key: v.cpu() for key, v in t.items()}
    check_scale_bias(host, fmt.bias_chunks)
    widened = {
        "weight": unpack_out_pairs(host["weight"]),  # (N, K) I8, values -8..7
        "weight_scale": host["weight_scale"],
        "weight_offset": host["weight_offset"],
    }
    inner = KERNELS[("w8a8_dynamic", ctx.name)](get_format("w8a8_dynamic"), widened, ctx)
    uses = f"int4 codes widened to int8 at load, then {inner.uses}"
    return Kernel(
        inner.fn, inner.in_features, inner.out_features, uses, inner.prepared, inner.act_dtypes
    )
