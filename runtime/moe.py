"""DeepSeek-V3 mixture-of-experts: the router (group-limited top-k) and the expert MLPs.

Routing for one token, with ``E = n_routed_experts`` split into ``G = n_group`` equal groups
(DeepSeek-V3 paper §2.1.2 and ``inference/model.py`` ``Gate``; config ``topk_method: noaux_tc``)::

    s      = sigmoid(x · Wgᵀ)                        # fp32 affinity per expert   [E]
    b      = s + e_score_correction_bias             # biased score, for choosing only
    group  = sum of the 2 largest b in each group     # [G]   (max of s when there is no bias)
    keep the topk_group best groups; the other groups' experts are excluded
    ids    = top-k of b over the kept experts        # num_experts_per_tok experts
    w      = s[ids]                                  # UNBIASED affinities of the chosen experts
    w      = w / sum(w)   if norm_topk_prob          # then
    w      = w · routed_scaling_factor

``scoring_func: softmax`` (DeepSeek-V2) uses ``softmax(x · Wgᵀ)`` for ``s``. The bias is used only
when ``topk_method`` is ``noaux_tc``; without it a group scores by its largest affinity, as in
DeepSeek's ``Gate``. With ``n_group == 1`` no group is excluded.

An expert (routed or shared) is ``down(silu(gate(x)) · up(x))``; the layer output is
``Σ_k w_k · expert_{ids_k}(x) + shared(x)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError

__all__ = ["LinearFn", "RouterSpec", "gated_mlp", "route", "routed_experts"]

LinearFn = Callable[[str, torch.Tensor], torch.Tensor]
"""``linear(module_prefix, x)``: ``x @ W[module_prefix]ᵀ`` (see ``runtime.model.Weights``)."""


@dataclass(frozen=True)
class RouterSpec:
    """The routing fields of a DeepSeek config."""

    n_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    n_group: int
    topk_group: int
    scoring: str  # "sigmoid" | "softmax"
    use_bias: bool  # topk_method == "noaux_tc": e_score_correction_bias steers the choice
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], n_experts: int) -> RouterSpec:
        need = ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "topk_method")
        missing = [k for k in need if raw.get(k) is None]
        if missing:
            raise HetquantError(f"config.json: MoE model lacks {', '.join(missing)}")
        spec = cls(
            n_experts=n_experts,
            top_k=int(raw["num_experts_per_tok"]),
            n_group=int(raw["n_group"]),
            topk_group=int(raw["topk_group"]),
            scoring=str(raw.get("scoring_func", "sigmoid")),
            use_bias=raw["topk_method"] == "noaux_tc",
            norm_topk_prob=bool(raw["norm_topk_prob"]),
            scaling=float(raw.get("routed_scaling_factor", 1.0)),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        e, g = self.n_experts, self.n_group
        if self.scoring not in ("sigmoid", "softmax"):
            raise HetquantError(f"config.json: scoring_func {self.scoring!r} is not supported")
        if g < 1 or e % g:
            raise HetquantError(
                f"config.json: n_routed_experts {e} is not divisible by n_group {g}"
            )
        if not 1 <= self.topk_group <= g:
            raise HetquantError(f"config.json: topk_group {self.topk_group} not in [1, {g}]")
        if not 1 <= self.top_k <= self.topk_group * (e // g):
            raise HetquantError(
                f"config.json: num_experts_per_tok {self.top_k} exceeds the "
                f"{self.topk_group * (e // g)} experts of the kept groups"
            )
        if g > 1 and self.use_bias and e // g < 2:
            raise HetquantError("config.json: noaux_tc group scoring needs >= 2 experts per group")


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts for each token (see module docstring).

    ``logits``: router logits, float32 [T, E]; ``bias``: ``e_score_correction_bias`` [E] (required
    iff ``spec.use_bias``). Returns ``topk_ids`` int64 [T, k] and ``topk_weights`` float32 [T, k].
    """
    if spec.use_bias and bias is None:
        raise HetquantError("route: topk_method noaux_tc needs e_score_correction_bias")
    t, e = logits.shape
    logits = logits.to(torch.float32)
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(-1)  # [T, E]
    choice = scores + bias.to(torch.float32) if spec.use_bias else scores  # [T, E]
    if spec.n_group > 1:
        per_group = e // spec.n_group
        grouped = choice.view(t, spec.n_group, per_group)  # [T, G, E/G]
        if spec.use_bias:
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        else:
            group_score = grouped.amax(-1)  # [T, G]
        kept = group_score.topk(spec.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros(t, spec.n_group, dtype=torch.bool, device=logits.device)  # [T, G]
        keep = keep.scatter_(1, kept, True)
        keep = keep.repeat_interleave(per_group, dim=1)  # [T, E]
        choice = choice.masked_fill(~keep, float("-inf"))  # [T, E]
    topk_ids = choice.topk(spec.top_k, dim=-1).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)  # [T, k], unbiased
    if spec.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    return topk_ids, topk_weights * spec.scaling


def gated_mlp(linear: LinearFn, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) · up(x))`` with the three linears under ``prefix`` ([T, H] → [T, H])."""
    gate = linear(f"{prefix}.gate_proj", x)  # [T, I]
    up = linear(f"{prefix}.up_proj", x)  # [T, I]
    return linear(f"{prefix}.down_proj", F.silu(gate) * up)  # [T, H]


def routed_experts(
    linear: LinearFn,
    prefix: str,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t])`` for each token, [T, H].

    ``prefix`` is the layer's ``…mlp.experts``; expert ``e`` uses ``{prefix}.{e}.*_proj``. Each hit
    expert runs once on the tokens routed to it (ascending expert id). Weights are cast to
    ``x``'s dtype before scaling, as DeepSeek's reference does.
    """
    out = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # [n], [n]
        y = gated_mlp(linear, f"{prefix}.{e}", x[tok])  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(x.dtype))
    return out
