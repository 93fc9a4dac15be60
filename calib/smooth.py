"""W8A8-aware scale search: the AWQ balance with the runtime's activation quantization in the
objective (``AwqOptions.act_aware``).

``awq.search_scale`` scores ``X · (Q(W·s)·s⁻¹ − W)ᵀ``: the weight's error only. A W8A8_DYNAMIC
linear also quantizes its input per token at run time (``formats/w8a8_npu.dynamic_quant``:
``scale = amax|x_t| / 127``, ``round(x · 127 / amax)``), and the fold changes that input to
``X · diag(s)⁻¹``: its per-token range and so its rounding. Here a linear whose target format
quantizes activations (``ACT_QUANT``) is scored by what the runtime computes::

    ‖ Qa(X · diag(s)⁻¹) · Q(W · diag(s))ᵀ − X · Wᵀ ‖²_F

and the others (the CPU experts: their GEMV takes activations exactly) as in ``awq``. The
candidates are AWQ's (``awq.scale_candidates``) plus SmoothQuant's (Xiao et al. 2022, arXiv
2211.10438, §4: ``s_α = max_t|X[t, c]|^α / max_n|W[n, c]|^(1−α)``), identity first, so the choice
is never worse than ``s = 1`` on the calibration tokens. Scored on at most ``n_tokens`` evenly
strided tokens per linear (every token when fewer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hetquant.formats import HetquantError
from hetquant.formats.w8a8_npu import dynamic_quant

from . import awq

__all__ = ["ACT_QUANT", "act_aware_search", "dynamic_fake_quant", "smooth_candidates"]


def dynamic_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``npu_dynamic_quant`` of ``x`` [T, K] dequantized: float32 [T, K]."""
    x_q, scale = dynamic_quant(x)
    return x_q.to(torch.float32) * scale[..., None]


ACT_QUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "w8a8_dynamic": dynamic_fake_quant,
}


def smooth_candidates(
    x_max: torch.Tensor, w_max: torch.Tensor, grid: int
) -> list[tuple[float, torch.Tensor]]:
    """SmoothQuant's ``(α, s [K])`` for α = k / grid, k ≤ grid; normalised as AWQ's."""
    out = []
    x_max, w_max = x_max.float().clamp(min=awq.SCALE_EPS), w_max.float().clamp(min=awq.SCALE_EPS)
    for k in range(grid + 1):
        a = k / grid
        s = x_max.pow(a) / w_max.pow(1 - a)
        s = s / (s.max() * s.min()).sqrt()
        out.append((a, torch.where(torch.isfinite(s), s, torch.ones_like(s))))
    return out


def act_aware_search(
    weights: Sequence[torch.Tensor],
    x: torch.Tensor | Sequence[torch.Tensor],
    quantizers: Sequence,
    grid: int = 20,
    *,
    x_mean: torch.Tensor | None = None,
    duo_scaling: bool = True,
    n_tokens: int = 4096,
) -> awq.ScaleSearch:
    """``awq.search_scale``'s contract with the module docstring's objective; ``ratio`` is the
    chosen α: AWQ's in [0, 1), SmoothQuant's as ``1 + α`` in [1, 2] (both kinds kept apart)."""
    ws, qs = list(weights), list(quantizers)
    xs = [x] * len(ws) if isinstance(x, torch.Tensor) else x
    if not ws or len(xs) != len(ws) or len(qs) != len(ws):
        raise HetquantError(f"act_aware_search: {len(ws)} weights, {len(xs)} inputs, {len(qs)} Q")
    quant = [(w, q) for w, q in zip(ws, qs, strict=True) if q is not None]
    if not quant:
        raise HetquantError("act_aware_search: no quantized weight to balance")
    if x_mean is None:
        x_mean = awq.activation_mean(xs[0] if isinstance(x, torch.Tensor) else xs)
    w_mean = awq.weight_mean([w for w, _ in quant], [q.group(w.shape[1]) for w, q in quant])
    cands = awq.scale_candidates(x_mean, w_mean, grid, duo_scaling=duo_scaling)
    x_max = _x_absmax(xs[0] if isinstance(x, torch.Tensor) else xs, ws[0].shape[1])
    w_max = torch.stack([w.float().abs().amax(0) for w, _ in quant]).amax(0)
    cands += [(1 + a, s) for a, s in smooth_candidates(x_max, w_max, grid)]
    sq = torch.zeros(len(cands), dtype=torch.float64)
    count = 0
    for i, (w, q) in enumerate(zip(ws, qs, strict=True)):
        if q is None:
            continue
        t = xs[i].reshape(-1, w.shape[1])
        if t.shape[0] == 0:
            continue
        t = t[:: max(1, t.shape[0] // n_tokens)].to(torch.float32)
        count += t.shape[0] * w.shape[0]
        w32 = w.to(torch.float32)
        act = ACT_QUANT.get(q.fmt.name)
        ref = t @ w32.T if act is not None else None  # (T', N)
        for c, (_, s) in enumerate(cands):
            if act is None:  # the weight's error alone (no cancellation)
                d = t @ (q(w32 * s) / s - w32).T
            else:
                d = act(t / s) @ q(w32 * s).T - ref
            sq[c] += float(d.pow(2).sum(dtype=torch.float64))
    losses = [float(v) / max(count, 1) for v in sq]
    best = min(range(len(cands)), key=lambda c: (losses[c], c))
    return awq.ScaleSearch.chosen(cands, losses, best)


def _x_absmax(x: torch.Tensor | Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """``max_t |x[t, :]|`` float32 [k] over the rows of ``x`` (or of several)."""
    xs = [x] if isinstance(x, torch.Tensor) else list(x)
    out = torch.zeros(k, dtype=torch.float32, device=xs[0].device)
    for t in xs:
        t2 = t.reshape(-1, k)
        if t2.shape[0]:
            out = torch.maximum(out, t2.abs().amax(0).to(torch.float32))
    return out
