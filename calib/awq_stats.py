"""Statistics of the AWQ search (``calib/awq.py`` states the objective): the activation and
relative weight magnitudes the scale candidates are built from, and the squared output error of
a weight error on the calibration inputs, directly or through the Gram matrix ``XᵀX``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetquant.formats import HetquantError
from hetquant.runtime.forward.precision import work_dtype

from .awq_quant import grouped

__all__ = ["CHUNK", "WMEAN_EPS", "activation_mean", "gram_matrix", "sq_out", "weight_mean"]

WMEAN_EPS = 1e-6  # AutoAWQ: |w| / (max|w| + 1e-6)
CHUNK = 8192  # token rows per matmul chunk


def activation_mean(x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """``mean_t |x[t, :]|`` float64 [K] over the rows of ``x`` [..., K] (or of several)."""
    xs = [x] if isinstance(x, torch.Tensor) else list(x)
    k = xs[0].shape[-1]
    total = torch.zeros(k, dtype=torch.float64, device=xs[0].device)
    rows = 0
    for t in xs:
        t2 = t.reshape(-1, k)
        for chunk in t2.split(CHUNK):
            total += chunk.abs().sum(0, dtype=torch.float64)
        rows += t2.shape[0]
    return total / max(rows, 1)


def weight_mean(weights: Sequence[torch.Tensor], groups: Sequence[int]) -> torch.Tensor:
    """AutoAWQ's ``w_mean`` float64 [K]: ``|W| / (max|W| of its group + 1e-6)`` (float32)
    averaged over the rows of all ``weights`` (each [N_i, K], its groups of ``groups[i]``
    columns) stacked, accumulated in float64 one weight at a time."""
    total, rows = None, 0
    for w, group_size in zip(weights, groups, strict=True):
        wg = grouped(w, group_size).abs()  # (N, K/g, g)
        rel = wg / (wg.amax(dim=-1, keepdim=True) + WMEAN_EPS)
        part = rel.reshape(w.shape).sum(0, dtype=torch.float64)  # [K]
        total = part if total is None else total + part
        rows += w.shape[0]
    if total is None:
        raise HetquantError("awq.weight_mean: no weights given")
    return total / rows


def gram_matrix(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``xᵀx`` [K, K] in ``work_dtype(dtype)``, accumulated over token chunks."""
    k, acc = x.shape[-1], work_dtype(dtype)
    g = torch.zeros(k, k, dtype=acc, device=x.device)
    for chunk in x.split(CHUNK):
        c = chunk.to(dtype)
        g += (c.T @ c).to(acc)
    return g


def sq_out(x: torch.Tensor, err: torch.Tensor, gram: torch.Tensor | None, dtype) -> torch.Tensor:
    """``‖x · errᵀ‖²_F`` for x [T, K], err [N, K] (via ``gram = xᵀx`` when given): a float64
    scalar on err's device (left there: the searches read all losses back at once)."""
    if gram is not None:
        e = err.to(gram.dtype)
        return ((e @ gram) * e).sum(dtype=torch.float64)
    e, acc = err.to(dtype), work_dtype(dtype)
    total = torch.zeros((), dtype=torch.float64, device=err.device)
    for chunk in x.split(CHUNK):
        total += (chunk.to(dtype) @ e.T).to(acc).pow(2).sum(dtype=torch.float64)
    return total
