"""The pure-torch INT4 GEMV path (``runtime/kernels/int4_gemv.py`` states the operands and the
formulas) and the operand checks every backend runs first.

The torch path is always available: unpack nibbles, subtract 8, convert to float32 (times the
group scales, exact) and matmul, in blocks of rows so the float copy stays small. Float32
rounding: ``|y − y_exact| ≲ γ_m · Σ|W||x|`` with ``γ_m = m·u/(1 − m·u)``, ``u = 2^-24``,
``m = K/2 + 1`` per-channel, ``K`` grouped.
"""

from __future__ import annotations

import torch

from hetquant.formats import HetquantError

__all__ = ["GROUP_SIZES", "check_operands", "int4_gemv_torch"]

GROUP_SIZES = (32, 64, 128)  # grouped scales the native kernel takes (whole 32-element blocks)
_TORCH_BLOCK_ELEMS = 1 << 22  # torch path: rows per block so that a float block is ~16 MB


def check_operands(
    packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor
) -> tuple[int, int, int]:
    """(N, K/2, group size; 0 per-channel) after checking shapes, dtypes and devices."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise HetquantError(
            f"int4_gemv: packed must be uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}"
        )
    n, kb = packed.shape
    group = 0
    if scale.ndim == 2:
        ng = scale.shape[1]
        group = 2 * kb // ng if ng else 0
        if (
            scale.shape[0] != n
            or scale.dtype != torch.bfloat16
            or group not in GROUP_SIZES
            or (group * ng != 2 * kb)
        ):
            raise HetquantError(
                f"int4_gemv: grouped scale {scale.dtype} {list(scale.shape)} for K = {2 * kb}; "
                f"expected bfloat16 [{n}, K/g] with g in {GROUP_SIZES}"
            )
    elif scale.shape != (n,):
        raise HetquantError(
            f"int4_gemv: scale shape {list(scale.shape)}, expected [{n}] (or [{n}, K/g])"
        )
    if x.ndim not in (1, 2) or x.shape[-1] != 2 * kb:
        raise HetquantError(
            f"int4_gemv: x shape {list(x.shape)}; expected [T, {2 * kb}] or [{2 * kb}]"
        )
    if not x.is_floating_point():
        raise HetquantError(f"int4_gemv: x must be floating point, got {x.dtype}")
    if packed.device.type != "cpu" or x.device.type != "cpu" or scale.device.type != "cpu":
        raise HetquantError("int4_gemv: CPU tensors only")
    return n, kb, group


def int4_gemv_torch(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The pure-torch path (module docstring): float32 [T, N] (or [N] for 1-D ``x``)."""
    n, kb, group = check_operands(packed, scale, x)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, 2 * kb).to(torch.float32)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    step = max(1, _TORCH_BLOCK_ELEMS // max(kb, 1))
    if group:
        for a in range(0, n, step):
            p = packed[a : a + step]
            q = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)  # [rows, K]
            w = q.to(torch.float32).sub_(8.0) * scale[a : a + step].float().repeat_interleave(
                group, dim=1
            )  # exact: a 4-bit code times a bf16 scale
            y[:, a : a + step] = x2 @ w.T
        return y[0] if squeeze else y
    xe, xo = x2[:, 0::2], x2[:, 1::2]  # [T, K/2]
    s = scale.to(torch.float32)
    for a in range(0, n, step):
        p = packed[a : a + step]
        lo = (p & 0xF).to(torch.float32).sub_(8.0)  # [rows, K/2]
        hi = (p >> 4).to(torch.float32).sub_(8.0)
        y[:, a : a + step] = (xe @ lo.T + xo @ hi.T) * s[a : a + step]
    return y[0] if squeeze else y
