"""Reference NPU ops of the Ascend W8A8 formats, emulated on CPU (torch_npu contracts,
reference/ascend_formats.md §3; ``formats/w8a8_npu.py`` documents the stored tensors):

* W8A8_DYNAMIC, ``npu_dynamic_quant`` + ``npu_quant_matmul(pertoken_scale=...)``: per token
  r = 127 / rowmax|x| (F32), x_q = rint(x * r), x_scale = 1 / r; then, accumulating in int32,
  ``y = dtype_x( f32(x_q @ q.T) * weight_scale * x_scale )``.
* W8A8 (vllm-ascend ``w8a8_static``): ``x_q = clamp(rint(x * (1/input_scale) + input_offset))``
  (``npu_quantize``, div_mode=False); ``y = dtype_x( f32(x_q @ q.T + quant_bias) * deq_scale )``.

Not verified on hardware: exact F32 dequant in the matmul (the fixpipe may truncate the scale),
correctly rounded F32 division on the vector unit, and ``npu_dynamic_quant`` on an all-zero row
(kernel: scale 1/inf = 0, CANN golden: 1; y = 0 either way; here 0 and 0).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._lazy import torch
from .base import get_format
from .errors import HetquantError
from .w8a8_npu_rows import INT8_MAX, INT8_MIN, check_tensors

__all__ = [
    "QUANT_MATMUL_MAX_DIM",
    "dynamic_quant",
    "dynamic_quant_matmul",
    "static_quant_matmul",
]

QUANT_MATMUL_MAX_DIM = 65535  # npu_quant_matmul: last dim of x1 (k) and x2 (n) at most this


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
    check_tensors(get_format("w8a8_dynamic"), tensors)
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
    check_tensors(get_format("w8a8"), tensors)
    if not torch.isfinite(x).all():
        raise HetquantError("static_quant_matmul: activations contain NaN/Inf")
    in_scale = tensors["input_scale"].reshape(1).to(param_dtype or torch.float32)
    recip = (1.0 / in_scale).to(torch.float32)  # (1,), rounded to param_dtype first
    offset = tensors["input_offset"].reshape(1).to(torch.float32)  # (1,)
    x_q = torch.round(x.to(torch.float32) * recip + offset).clamp(INT8_MIN, INT8_MAX)  # (..., k)
    acc = _int_matmul(x_q.to(torch.int8), tensors["weight"]) + tensors["quant_bias"]  # (..., n)
    return (acc.to(torch.float32) * tensors["deq_scale"]).to(x.dtype)  # (..., n)
