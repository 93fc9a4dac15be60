"""Applying an AWQ scale (``calib/awq.py``): ``diag(s)⁻¹`` folded into the producer of the input
(an RMSNorm or the previous linear's output rows) and ``diag(s)`` into the balanced weights, so
that the float model is unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["fold_into_linear", "fold_into_norm", "scale_columns"]


def _dt(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """float32, or float64 when either operand is float64."""
    return torch.promote_types(torch.float32, torch.promote_types(a.dtype, b.dtype))


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RMSNorm weight [K] ÷ s: the norm then outputs ``x · diag(s)⁻¹`` (float32 or 64)."""
    dt = _dt(norm_weight, s)
    return norm_weight.to(dt) / s.to(dt)


def fold_into_linear(
    prev_weight: torch.Tensor, s: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Previous linear's output rows ÷ s (all rows, or ``rows`` [K] index): a float32 (or 64)
    copy."""
    dt = _dt(prev_weight, s)
    out, s = prev_weight.to(dt), s.to(dt)
    if rows is None:
        return out / s[:, None]
    out = out.clone()
    out[rows] = out[rows] / s[:, None]
    return out


def scale_columns(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``W · diag(s)``: input column c times s[c] (float32 or 64) — the balanced weight, or the
    router compensated for a fold into the norm it shares."""
    dt = _dt(w, s)
    return w.to(dt) * s.to(dt)
