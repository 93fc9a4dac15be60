"""The AWQ clip search (``calib/awq.py`` states the objective): per output row and input group,
the shrink step of ``max|W|`` whose clipped, quantized weights give the least output error, and
the bounds the converter turns those steps back into.
"""

from __future__ import annotations

import torch

from hetquant.runtime.forward.precision import work_dtype

from .awq_quant import FakeQuant, grouped
from .awq_scale import TIE_RTOL

__all__ = [
    "CLIP_BATCH_BYTES",
    "apply_clip",
    "clip_bounds",
    "clip_factors",
    "clip_rows_per_batch",
    "search_clip",
]


def clip_factors(grid: int, max_shrink: float) -> torch.Tensor:
    """``1 - i / grid`` for the shrink steps ``i < int(max_shrink · grid)``, float32."""
    return torch.tensor([1 - i / grid for i in range(int(max_shrink * grid))], dtype=torch.float32)


def clip_bounds(w: torch.Tensor, shrink: torch.Tensor, group_size: int, factors: torch.Tensor):
    """``max|W| of each group · factors[shrink]``: float32 [N, K/g] bounds for ``w`` [N, K]."""
    amax = grouped(w, group_size).abs().amax(dim=-1)  # (N, K/g)
    return amax * factors.to(amax.device)[shrink.long()]


def apply_clip(w: torch.Tensor, bounds: torch.Tensor, group_size: int) -> torch.Tensor:
    """``clamp(w, -bound, bound)`` per group: float32 [N, K]."""
    wg = grouped(w, group_size)
    b = bounds[..., None]  # (N, K/g, 1)
    return torch.maximum(torch.minimum(wg, b), -b).reshape(w.shape)


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    q: FakeQuant,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    rows_per_batch: int | None = None,
) -> torch.Tensor:
    """Best shrink step per (row, group) for ``w`` [N, K] quantized by ``q`` (groups of
    ``g = q.group(K)`` columns) on inputs ``x`` [T, K]: uint8 [N, K/g].

    See the module docstring. Tokens are taken every ``max(1, T // n_tokens)``-th (AutoAWQ).
    With no token every step is 0 (no clipping). Errors are computed in ``work_dtype`` of
    ``x``'s dtype (float64 for float64 inputs); a larger shrink replaces a smaller one only if
    its error is lower by more than ``TIE_RTOL`` relative.
    ``rows_per_batch``: rows searched together (default :func:`clip_rows_per_batch`: AutoAWQ's
    256 on the CPU, as many as fit a working set of ``CLIP_BATCH_BYTES`` on an accelerator,
    where launching ~15 kernels per 256 rows and step dominated: 0.15 s of a DeepSeek
    down_proj's 0.16 s on an H100).
    """
    n, k = w.shape
    group_size = q.group(k)
    groups = k // group_size
    best = torch.zeros(n, groups, dtype=torch.uint8, device=w.device)
    t = x.reshape(-1, k)
    if t.shape[0] == 0:
        return best
    acc = work_dtype(x.dtype)
    t = t[:: max(1, t.shape[0] // n_tokens)].to(acc)
    xg = t.reshape(-1, groups, group_size).transpose(0, 1)  # (G, T', g)
    factors = clip_factors(grid, max_shrink).to(w.device)
    rows = rows_per_batch or clip_rows_per_batch(w.device, k, groups, t.shape[0])
    for r0 in range(0, n, rows):
        wr = w[r0 : r0 + rows].to(torch.float32)  # (n', K)
        wg = wr.reshape(wr.shape[0], groups, group_size)
        amax = wg.abs().amax(dim=-1)  # (n', G)
        best_err = torch.full(amax.shape, float("inf"), dtype=acc, device=w.device)
        best_i = torch.zeros(amax.shape, dtype=torch.uint8, device=w.device)
        for i in range(factors.numel()):
            b = (amax * factors[i])[..., None]  # (n', G, 1)
            clipped = torch.maximum(torch.minimum(wg, b), -b).reshape(wr.shape)
            d = (q(clipped) - wr).reshape(wg.shape).to(acc)  # (n', G, g)
            out = torch.bmm(xg, d.permute(1, 2, 0))  # (G, T', n'): per-group partial outputs
            err = out.pow(2).mean(dim=1).T  # (n', G)
            better = err < best_err * (1 - TIE_RTOL)
            best_err = torch.where(better, err, best_err)
            best_i = torch.where(better, i, best_i)  # no host sync per step
        best[r0 : r0 + rows] = best_i
    return best


CLIP_BATCH_BYTES = 1 << 30  # an accelerator's working set per clip-search row batch


def clip_rows_per_batch(device: torch.device, k: int, groups: int, tokens: int) -> int:
    """Rows :func:`search_clip` searches together for a weight of ``k`` input columns in
    ``groups`` groups and ``tokens`` sampled tokens: 256 on the CPU (AutoAWQ's batch; the CPU
    path's results stay as they were), else as many as keep the float32 working set — the
    per-group outputs (``groups · tokens`` per row) and ~4 weight-sized temporaries (``k`` per
    row) — under ``CLIP_BATCH_BYTES``, at least 256."""
    if device.type == "cpu":
        return 256
    per_row = 4 * (groups * tokens + 4 * k)  # bytes
    return max(256, CLIP_BATCH_BYTES // per_row)
