"""GPTQ error feedback for symmetric per-row / per-group INT4 codes (the hybrid's CPU experts).

Frantar et al. 2022 (arXiv 2210.17323, Algorithm 1), written from the paper. For a linear
``W`` [N, K] reading inputs ``X`` [T, K], with ``H = 2·XᵀX`` (+ dampening ``λ·mean diag H·I``):
columns are quantized one at a time, each column's rounding error ``(w_j − q_j) / U[j, j]``
(``U`` the upper Cholesky factor of ``H⁻¹``) is spread over the columns not yet quantized
(``W[:, j+1:] −= err ⊗ U[j, j+1:]``), which minimises ``‖X·(Q − W)ᵀ‖²`` column by column where
round-to-nearest ignores the inputs. Lazy batches of ``block`` columns (the paper's §3 step 2).

The grid is fixed before the search: the target format's own scale, one per row (``int4_cpu``)
or per row and group (``int4_cpu_group``, static groups: the stored layout stays the format's),
taken from the AWQ-scaled and clipped weight ``W_c``. Act-order (columns by descending
``diag H``) only changes the order the columns are visited in; each column keeps its group's
scale, so it is free here.

Storage (``GRIDS``): the result must be stored EXACTLY by the converter, which re-quantizes the
weight it is handed with the format's round-to-nearest. The weight handed over is
``W' = q · s`` (the codes times the grid), and round-to-nearest of ``W'`` gives back ``q`` and
``s`` bit for bit when (a) every (row, group) with a non-zero scale holds a code ``±qmax`` — so
``amax(W'[r, group]) = qmax · s`` — and (b) ``s`` is a fixed point of the format's scale rule
on such a group. (b) is met by taking the grid from the round trip ``Q(W_c)`` rather than
``W_c`` (``int4_cpu``'s ``fl(fl(7s)/7)`` is not ``s`` for ~10% of floats, but it is idempotent;
BF16 scales are exact); (a) by forcing, in each (row, group), the column where ``|W_c|`` peaks
to ``±qmax`` (its sign) when it is visited — its error is fed back like any other. ``gptq``
checks ``Q(W') == W'`` and raises otherwise; ``tests/calib/test_gptq.py`` checks both formats'
round trips and the stored codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetquant.formats import HetquantError
from hetquant.runtime.forward.precision import work_dtype

from .quantizer import Quantizer

__all__ = ["GRIDS", "GptqResult", "gptq", "hessian"]

GRIDS: dict[str, int] = {"int4_cpu": 7, "int4_cpu_group": 7}  # format → qmax of q·s codes
_CHUNK = 8192  # token rows per matmul chunk


@dataclass(frozen=True)
class GptqResult:
    """``codes`` int8 [N, K] (in ``[−qmax, qmax]``) and ``scale`` float32 [N, G]: the weight
    ``q · s`` (groups of ``K / G`` columns) that the format stores as exactly these."""

    codes: torch.Tensor
    scale: torch.Tensor

    def weight(self) -> torch.Tensor:
        """``q · s``: float32 [N, K]."""
        group = self.codes.shape[1] // self.scale.shape[1]
        return self.codes.to(torch.float32) * self.scale.repeat_interleave(group, dim=1)


def hessian(x: torch.Tensor, k: int) -> torch.Tensor:
    """``2·XᵀX / T`` [k, k] of inputs ``x`` [..., k] (T rows; zeros when T = 0), float32
    (float64 for float64 ``x``: ``runtime/forward/precision.py``)."""
    t, acc = x.reshape(-1, k), work_dtype(x.dtype)
    h = torch.zeros(k, k, dtype=acc, device=x.device)
    for chunk in t.split(_CHUNK):
        c = chunk.to(acc)
        h += c.T @ c
    return h * (2.0 / max(t.shape[0], 1))


def _grid(q: Quantizer, w_clipped: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(scale float32 [N, G], qmax): the format's scales of ``Q(w_clipped)`` (module docstring)."""
    qmax = GRIDS.get(q.fmt.name)
    if qmax is None:
        raise HetquantError(
            f"gptq: target format {q.fmt.name} has no symmetric q·s grid; GPTQ supports "
            f"{sorted(GRIDS)}"
        )
    stored = q.fmt.quantize(q(w_clipped))
    return stored["weight_scale"].to(torch.float32).reshape(w_clipped.shape[0], -1), qmax


def gptq(
    name: str,
    w: torch.Tensor,
    w_clipped: torch.Tensor,
    h: torch.Tensor,
    q: Quantizer,
    *,
    damp: float = 0.01,
    block: int = 128,
    act_order: bool = True,
) -> GptqResult:
    """GPTQ codes of ``w`` [N, K] (the AWQ-scaled weight) on the grid of ``w_clipped`` (the same
    weight clipped as the converter would) for Hessian ``h`` [K, K]; ``name`` for messages. The
    error feedback runs in ``h``'s precision (float32, or float64 for a float64 Hessian)."""
    n, k = w.shape
    scale, qmax = _grid(q, w_clipped)  # (N, G)
    group = k // scale.shape[1]
    wg = w_clipped.to(torch.float32).reshape(n, -1, group)  # (N, G, g)
    peak = wg.abs().argmax(dim=-1)  # (N, G): column of the group's amax
    anchor = torch.zeros(n, k, dtype=torch.bool, device=w.device)
    cols = peak + torch.arange(0, k, group, device=w.device)  # (N, G) absolute columns
    anchor.scatter_(1, cols, wg.abs().amax(dim=-1) > 0)  # all-zero groups: no anchor
    sign = torch.sign(w_clipped.to(torch.float32))
    acc = work_dtype(h.dtype)
    h = h.to(acc).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, device=h.device)
    perm = (
        torch.argsort(torch.diag(h), descending=True, stable=True)
        if act_order
        else torch.arange(k, device=h.device)
    )
    s_col = scale.repeat_interleave(group, dim=1)[:, perm].to(acc)  # (N, K) in visiting order
    work = w.to(acc)[:, perm].clone()
    anchor, sign = anchor[:, perm], sign[:, perm]
    u = _inverse_cholesky(h[perm][:, perm], name)  # (K, K) upper
    codes = torch.zeros(n, k, dtype=acc, device=w.device)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = work[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        for j in range(b1 - b0):
            c = b0 + j
            col = wb[:, j]
            qc = torch.clamp(torch.round(col / s_col[:, c]), -qmax, qmax)
            qc = torch.where(anchor[:, c], sign[:, c] * qmax, qc)
            codes[:, c] = qc
            e = (col - qc * s_col[:, c]) / u[c, c]
            wb[:, j:] -= e[:, None] * u[c, c:b1][None, :]
            err[:, j] = e
        work[:, b1:] -= err @ u[b0:b1, b1:]
    out = GptqResult(codes[:, torch.argsort(perm)].to(torch.int8), scale)
    w_out = out.weight()
    if not torch.equal(q(w_out), w_out):
        raise HetquantError(
            f"{name}: {q.fmt.name}'s round-to-nearest does not reproduce the GPTQ codes; the "
            "format's scale rule is not idempotent on q·s (calib/gptq.py's module docstring)"
        )
    return out


def _inverse_cholesky(h: torch.Tensor, name: str) -> torch.Tensor:
    """Upper Cholesky factor of ``h⁻¹`` (float64 for the factorisations), in ``h``'s dtype."""
    h64 = h.to(torch.float64)
    lower, info = torch.linalg.cholesky_ex(h64)
    if int(info):
        raise HetquantError(f"{name}: GPTQ's Hessian is not positive definite; raise the damping")
    hinv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(hinv, upper=True).to(h.dtype)
