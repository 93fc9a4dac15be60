"""Who computes what in the CPU expert pool: the routed entries grouped by expert (``Routing``,
made from ``forward``'s top-k by ``_route``), the experts a subpool owns (``_expert_block``) and
the checks that a layer can be split as asked (``_check_split``, ``SPLITS``) and of the pool's
other options (``_check_options``).

With ``split="inter"`` every subpool owns every expert (a slice of its intermediate dimension);
with ``split="experts"`` subpool ``s`` owns the contiguous block ``_expert_block(E, s, S)``, and
``Routing.owned`` gives the entries of that block.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hetquant.formats import HetquantError

from ..kernels.int4_gemv import BACKENDS, PRECISIONS
from ._expert_files import ExpertLayerInfo

__all__ = ["SPLITS", "Routing", "_check_options", "_check_split", "_expert_block", "_route"]

SPLITS = ("inter", "experts")


class Routing(NamedTuple):
    """Routed entries grouped by expert: expert ``experts[g]`` (ascending) takes the entries
    ``offsets[g] .. offsets[g+1]-1`` of ``tokens`` (int64) and ``weights`` (float32)."""

    experts: torch.Tensor
    offsets: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor

    def owned(self, start: int, stop: int) -> Routing | None:
        """The entries of experts ``start .. stop-1`` (None if there are none)."""
        a, b = torch.searchsorted(self.experts, torch.tensor([start, stop])).tolist()
        if a == b:
            return None
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        return Routing(
            self.experts[a:b], self.offsets[a : b + 1] - lo, self.tokens[lo:hi], self.weights[lo:hi]
        )


def _expert_block(num_experts: int, s: int, n: int) -> tuple[int, int]:
    return s * num_experts // n, (s + 1) * num_experts // n


def _check_split(infos: dict[int, ExpertLayerInfo], subpools: int, split: str) -> None:
    for info in infos.values():
        if split == "inter":
            try:
                info.fmt.check_subpools(info.inter, subpools)
            except HetquantError as e:
                raise HetquantError(
                    f"CpuExpertPool (layer {info.layer}, {info.fmt.name}): {e}; or split='experts'"
                ) from None
        elif subpools > info.num_experts:
            raise HetquantError(
                f"CpuExpertPool: {subpools} subpools for {info.num_experts} experts (layer "
                f"{info.layer}); split='experts' needs at most one subpool per expert"
            )


def _route(
    info: ExpertLayerInfo, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> Routing:  # fmt: skip
    """``forward``'s top-k choices [T, k] grouped by expert (checked against ``x`` [T, H] and the
    layer's experts first); weights cast to ``x``'s dtype, then float32."""
    if x.ndim != 2:
        raise HetquantError(f"forward: x must be [T, H], got {list(x.shape)}")
    t = x.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise HetquantError(
            f"forward: topk_ids {list(topk_ids.shape)} and topk_weights "
            f"{list(topk_weights.shape)} must both be [T={t}, k]"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise HetquantError(f"forward: topk_ids must be integers, got {topk_ids.dtype}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= info.num_experts):
        raise HetquantError(f"forward: topk_ids outside 0..{info.num_experts - 1} (layer {layer})")
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    w_all = topk_weights.to(x.dtype).to(torch.float32).reshape(-1)[order]
    offsets = torch.zeros(ids.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Routing(ids, offsets, order // k, w_all)


def _check_options(subpools: int, split: str, backend: str, precision: str) -> None:
    """``CpuExpertPool.open``'s arguments before anything is opened."""
    if isinstance(subpools, bool) or not isinstance(subpools, int) or subpools < 1:
        raise HetquantError(f"CpuExpertPool: subpools = {subpools!r}; need an integer >= 1")
    if split not in SPLITS:
        raise HetquantError(f"CpuExpertPool: split {split!r} not in {SPLITS}")
    if backend not in BACKENDS:
        raise HetquantError(f"CpuExpertPool: backend {backend!r} not in {BACKENDS}")
    if precision not in PRECISIONS:
        raise HetquantError(f"CpuExpertPool: precision {precision!r} not in {tuple(PRECISIONS)}")
