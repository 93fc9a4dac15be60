"""DeepSeek-V3 mixture-of-experts: the router (group-limited top-k) and the expert MLPs.

Routing for one token, with the ``E = n_experts`` routed experts split into ``G = n_group`` equal
groups (``RouterSpec`` fields; DeepSeek-V3 paper §2.1.2 and ``inference/model.py`` ``Gate``)::

    s      = sigmoid(x · Wgᵀ)                        # fp32 affinity per expert   [E]
    b      = s + bias                                # biased score (use_bias), for choosing only
    group  = sum of the 2 largest b in each group     # [G]   (max of s when there is no bias)
    keep the topk_group best groups; the other groups' experts are excluded
    ids    = top-k of b over the kept experts        # top_k experts
    w      = s[ids]                                  # UNBIASED affinities of the chosen experts
    w      = w / sum(w)   if norm_topk_prob          # then
    w      = w · scaling

``scoring == "softmax"`` (DeepSeek-V2) uses ``softmax(x · Wgᵀ)`` for ``s``. Without ``use_bias``
a group scores by its largest affinity, as in DeepSeek's ``Gate``. With ``n_group == 1`` no group
is excluded. ``RouterSpec`` is parsed from config.json by the DeepSeek-V3 family
(``formats/families/deepseek_v3.py``, which names the config keys); Qwen3-MoE's router is the
softmax, one-group, unbiased, unscaled case (``qwen3_moe.py`` ``Qwen3MoeConfig.router``).

An expert (routed or shared) is ``down(silu(gate(x)) · up(x))`` — with a SwiGLU ``limit``
(DeepSeek-V4's ``swiglu_limit``) ``down(silu(min(gate(x), limit)) · clamp(up(x), ±limit))``,
as transformers 5.24 ``modeling_deepseek_v4.py:1030-1034, 1067-1074`` clips it; the layer output is
``Σ_k w_k · expert_{ids_k}(x) + shared(x)``. Module names come from the family's role table
(``ModelFamily.mlp_modules``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families.deepseek_v3 import RouterSpec

from .precision import work_dtype

__all__ = ["LinearFn", "RouterSpec", "gated_mlp", "route", "routed_experts", "swiglu"]

LinearFn = Callable[[str, torch.Tensor], torch.Tensor]
"""``linear(module_prefix, x)``: ``x @ W[module_prefix]ᵀ`` (see ``runtime.model.Weights``)."""


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts for each token (see module docstring).

    ``logits``: router logits [T, E], scored in float32 (float64 logits in float64:
    ``precision.py``); ``bias``: the router bias [E] (required iff ``spec.use_bias``). Returns
    ``topk_ids`` int64 [T, k] and ``topk_weights`` [T, k] in that precision.
    """
    if spec.use_bias and bias is None:
        raise HetquantError("route: this router (use_bias) needs its bias tensor")
    t, e = logits.shape
    logits = logits.to(work_dtype(logits.dtype))
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(-1)  # [T, E]
    choice = scores + bias.to(scores.dtype) if spec.use_bias else scores  # [T, E]
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


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) · up``; with ``limit``, gate clipped above at ``limit`` and up to ``±limit``."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def gated_mlp(
    linear: LinearFn, modules: Sequence[str], x: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """``down(swiglu(gate(x), up(x), limit))`` with ``modules`` = (gate, up, down) ([T, H] → [T, H])."""
    gate_m, up_m, down_m = modules
    gate = linear(gate_m, x)  # [T, I]
    up = linear(up_m, x)  # [T, I]
    return linear(down_m, swiglu(gate, up, limit))  # [T, H]


def routed_experts(
    linear: LinearFn,
    modules: Callable[[int], Sequence[str]],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """``Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t])`` for each token, [T, H].

    ``modules(e)``: expert ``e``'s (gate, up, down) module names; ``limit``: the SwiGLU clip.
    Each hit expert runs once on the tokens routed to it (ascending expert id). Weights are cast
    to ``x``'s dtype before scaling, as DeepSeek's reference does.
    """
    out = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # [n], [n]
        y = gated_mlp(linear, modules(e), x[tok], limit)  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(x.dtype))
    return out
