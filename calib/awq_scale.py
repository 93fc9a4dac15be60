"""The AWQ scale search (``calib/awq.py`` states the objective, the candidates and the
reproducibility rules): candidates ``s_α`` from the activation and weight statistics, each
scored by the output error of its quantized weights, the earliest best kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetquant.formats import HetquantError

from .awq_quant import FakeQuant
from .awq_stats import activation_mean, gram_matrix, sq_out, weight_mean

__all__ = [
    "SCALE_BITS",
    "SCALE_EPS",
    "TIE_RTOL",
    "ScaleSearch",
    "first_min",
    "scale_candidates",
    "search_scale",
]

SCALE_EPS = 1e-4  # AutoAWQ: (x^α / (w^(1-α) + 1e-4)).clamp(min=1e-4)
SCALE_BITS = 12  # significant bits of every scale candidate (awq.py docstring, Reproducibility)
TIE_RTOL = 1e-9  # losses closer than this (relative) are ties: the earlier choice is kept


def scale_candidates(
    x_mean: torch.Tensor,
    w_mean: torch.Tensor,
    grid: int = 20,
    *,
    duo_scaling: bool = True,
    pow2: bool = False,
) -> list[tuple[float | None, torch.Tensor]]:
    """(α, s [K] float32) candidates, identity first (α None), duplicates removed; computed in
    float64 and rounded to ``SCALE_BITS`` significant bits (module docstring)."""
    x_mean, w_mean = x_mean.to(torch.float64), w_mean.to(torch.float64)
    out: list[tuple[float | None, torch.Tensor]] = [
        (None, torch.ones_like(x_mean, dtype=torch.float32))
    ]
    made: list[tuple[float, torch.Tensor]] = []
    for k in range(grid):
        a = k / grid
        if duo_scaling:
            s = (x_mean.pow(a) / (w_mean.pow(1 - a) + SCALE_EPS)).clamp(min=SCALE_EPS)
        else:
            s = x_mean.pow(a).clamp(min=SCALE_EPS)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        if pow2:
            s = torch.exp2(torch.round(torch.log2(s)))
        made.append((a, _significant(s, SCALE_BITS)))
    host = torch.stack([out[0][1], *(s for _, s in made)]).cpu() if made else None  # one sync
    kept = [0]  # rows of ``host`` kept
    for j, (a, s) in enumerate(made, start=1):
        if not any(torch.equal(host[j], host[i]) for i in kept):
            kept.append(j)
            out.append((a, s))
    return out


def _significant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Positive float64 ``x`` rounded to ``bits`` significant bits (ties to even): float32,
    exactly (``bits`` ≤ 24)."""
    m, e = torch.frexp(x)  # x = m · 2^e, m in [0.5, 1); times / by 2^bits are exact
    return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e).to(torch.float32)


def first_min(losses: Sequence[float], rtol: float = TIE_RTOL) -> int:
    """Index of the smallest loss, the earliest kept unless a later one is lower by more than
    ``rtol`` relative (module docstring, Reproducibility)."""
    best = 0
    for c in range(1, len(losses)):
        if losses[c] < losses[best] * (1 - rtol):
            best = c
    return best


@dataclass(frozen=True)
class ScaleSearch:
    """Outcome of :func:`search_scale`.

    ``scales`` float32 [K]; ``ratio`` the chosen α (None: identity won); ``loss`` and
    ``identity_loss`` the objective (mean squared output error) at the choice and at ``s = 1``
    (plain round-to-nearest); ``losses`` every (α, loss) evaluated, identity first.
    """

    scales: torch.Tensor
    ratio: float | None
    loss: float
    identity_loss: float
    losses: tuple[tuple[float | None, float], ...]

    @classmethod
    def chosen(
        cls,
        cands: Sequence[tuple[float | None, torch.Tensor]],
        losses: Sequence[float],
        best: int,
    ) -> ScaleSearch:
        """Candidate ``best`` of ``cands`` (α, s), identity first, with each one's loss."""
        return cls(
            scales=cands[best][1],
            ratio=cands[best][0],
            loss=losses[best],
            identity_loss=losses[0],
            losses=tuple((a, v) for (a, _), v in zip(cands, losses, strict=True)),
        )


def search_scale(
    weights: Sequence[torch.Tensor],
    x: torch.Tensor | Sequence[torch.Tensor],
    quantizers: Sequence[FakeQuant | None],
    grid: int = 20,
    *,
    x_mean: torch.Tensor | None = None,
    duo_scaling: bool = True,
    pow2: bool = False,
    matmul_dtype: torch.dtype = torch.float32,
) -> ScaleSearch:
    """The AWQ scale shared by ``weights`` (each [N_i, K]); see the module docstring.

    ``quantizers``: each weight's ``Q`` (None: kept in float, adds no error; at least one must
    be given). ``x``: the input [T, K] all weights read, or one input [T_i, K] per weight (T_i
    may be 0: a routed expert that saw no token adds nothing to the objective); a Sequence may
    make its items on demand, so that only one expert's rows exist at a time. ``x_mean``: the
    activation statistic (default: :func:`activation_mean` of ``x``). The output error of each candidate is
    computed as ``X · (Q(W·diag(s))·diag(s)⁻¹ − W)ᵀ`` (equal to the objective's difference, with
    no cancellation), through the Gram matrix ``XᵀX`` when T_i > K. Matmuls run in
    ``matmul_dtype`` (bfloat16 is enough to rank candidates on an accelerator; float64 makes the
    choice the same on every CPU); the Gram matrices and error sums in float32 (float64 with
    float64 matmuls). Ties within ``TIE_RTOL`` keep the earlier candidate (identity first).
    """
    ws, qs = list(weights), list(quantizers)
    xs = [x] * len(ws) if isinstance(x, torch.Tensor) else x  # may be a lazy Sequence
    if not ws or len(xs) != len(ws) or len(qs) != len(ws):
        raise HetquantError(
            f"awq.search_scale: {len(ws)} weights, {len(xs)} inputs, {len(qs)} quantizers"
        )
    quant = [(w, q) for w, q in zip(ws, qs, strict=True) if q is not None]
    if not quant:
        raise HetquantError("awq.search_scale: no quantized weight to balance")
    if x_mean is None:
        x_mean = activation_mean(xs[0] if isinstance(x, torch.Tensor) else xs)
    w_mean = weight_mean([w for w, _ in quant], [q.group(w.shape[1]) for w, q in quant])
    cands = scale_candidates(x_mean, w_mean, grid, duo_scaling=duo_scaling, pow2=pow2)
    losses = _mean_losses(ws, qs, xs, cands, quant[0][0].device, matmul_dtype)
    return ScaleSearch.chosen(cands, losses, first_min(losses))


def _mean_losses(
    ws: Sequence[torch.Tensor],
    qs: Sequence[FakeQuant | None],
    xs: Sequence[torch.Tensor],
    cands: Sequence[tuple[float | None, torch.Tensor]],
    dev: torch.device,
    matmul_dtype: torch.dtype,
) -> list[float]:
    """The objective at every candidate: the squared output errors of the quantized weights,
    summed over their tokens and divided by ``Σ_i T_i · N_i`` (:func:`search_scale`)."""
    sq = [torch.zeros((), dtype=torch.float64, device=dev) for _ in cands]  # no sync per step
    count = 0
    grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(x) → (x kept alive, xᵀx)
    for i, (w, q) in enumerate(zip(ws, qs, strict=True)):
        if q is None:
            continue
        xi = xs[i]
        t = xi.reshape(-1, w.shape[1])
        if t.shape[0] == 0:
            continue
        count += t.shape[0] * w.shape[0]
        w32 = w.to(torch.float32)
        gram = None
        if t.shape[0] > w.shape[1]:
            if id(xi) not in grams:
                grams[id(xi)] = (xi, gram_matrix(t, matmul_dtype))
            gram = grams[id(xi)][1]
        for c, (_, s) in enumerate(cands):
            err = q(w32 * s) / s - w32  # (N, K)
            sq[c] += sq_out(t, err, gram, matmul_dtype)
    return [float(v) / max(count, 1) for v in torch.stack(sq).cpu()]
