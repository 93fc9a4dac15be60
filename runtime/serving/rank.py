"""One rank of a sharded DeepSeek-V3: a weights provider over the tensors ``Artifact.load`` gave it.

``RankWeights`` implements ``runtime.model.Weights`` for one rank of a ``ParallelLayout``:

- ``linear(prefix, x)`` runs the module's ``QuantLinear`` (built once, on the backend, from this
  rank's stored tensors). A module split along its IN dim (row-parallel: o, down) returns a
  partial sum, all-reduced over the group; one split along OUT (column-parallel: q_b, kv_b,
  gate/up) returns this rank's slice — the forward derives its local head count from the shape;
  the vocab-split lm_head's slices are all-gathered into full logits. Which is which: the
  artifact's placement (``parallel/placement.py``; each module placed once, at open).
- ``embed(tokens)``: a vocab-parallel lookup (rows this rank does not hold give 0), all-reduced.
- ``experts(layer, x, ids, weights)``: one partial sum per rank, all-reduced once per layer:
  under TP every expert's slices; under EP the experts this rank owns (a logical expert held in
  several physical slots — EPLB's redundant experts — counts once, at its first slot); with a CPU
  expert pool (``ascend-hybrid``) the pool computes the layer on group rank 0.

``Comm`` (``collectives.py``) is the group's collectives over the run's backend (gloo, nccl,
hccl); ``Comm()`` is a single rank.
``run_stage`` runs this pipeline stage's layers (embedding on the first stage, final norm and
lm_head on the last).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError

from ..forward.model import DecoderReference
from ..forward.moe import swiglu
from ..kernels.ops import QuantLinear
from ..parallel.layout import ParallelLayout
from ..parallel.pieces import IN, OUT
from ..parallel.placement import ModelPlacement, split_of, split_range
from .collectives import Comm

__all__ = ["Comm", "RankWeights", "run_stage"]


class RankWeights:
    """This rank's weights (see the module docstring)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        placement: ModelPlacement,
        layout: ParallelLayout,
        *,
        backend: str = "cpu",
        comm: Comm | None = None,
        pool: Any = None,
        npu_ops: Any = None,
    ) -> None:
        self.t, self.placement, self.layout = dict(tensors), placement, layout
        self.modules, self.cfg, self.fam = placement.modules, placement.cfg, placement.family
        self.backend, self.comm, self.pool, self.npu_ops = backend, comm or Comm(), pool, npu_ops
        first = next(iter(self.t.values()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._linears: dict[str, QuantLinear] = {}

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.t[name]
        except KeyError:
            raise HetquantError(f"rank weights: this rank holds no tensor {name!r}") from None

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(name)(x)  # [..., out (this rank's part)]
        pl = self.placement.role(name)
        dim = split_of(pl, self.layout)
        if dim == IN:
            return self.comm.all_reduce(y)
        if dim == OUT and pl.rule.group == "head":
            return self._gather_vocab(y)
        return y

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.get(self.fam.tensor("embed"))  # [V_r, D]
        pl = self.placement.role(self.fam.module("embed"))
        if split_of(pl, self.layout) is None:
            return table[tokens]
        lo, hi = split_range(pl, self.cfg.vocab_size, self.comm.size, self.comm.rank)
        tokens = tokens.to(table.device)
        mine = (tokens >= lo) & (tokens < hi)  # [T]
        out = table.new_zeros(tokens.shape[0], table.shape[1])  # [T, D]
        out[mine] = table[tokens[mine] - lo]
        return self.comm.all_reduce(out)

    def experts(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if self.pool is not None and layer in self.pool.layers:
            y = (  # the pool is on the host: activations travel there and back
                self.pool.forward(layer, x.cpu(), topk_ids.cpu(), topk_weights.cpu(), limit).to(
                    x.device
                )
                if self.comm.rank == 0
                else torch.zeros_like(x)
            )
            return self.comm.all_reduce(y)
        y = torch.zeros_like(x)  # [T, D]
        for e in self._computed_experts(layer):
            hit = topk_ids == e  # [T, k]
            rows = hit.any(-1).nonzero().squeeze(-1)  # [n]
            if rows.numel() == 0:
                continue
            xe = x[rows]  # [n, D]
            gate, up, down = self.fam.mlp_modules("routed", layer, e)
            act = swiglu(self._linear(gate)(xe), self._linear(up)(xe), limit)  # [n, I_r]
            weight = (topk_weights * hit).sum(-1)[rows]  # [n]
            y[rows] += self._linear(down)(act) * weight[:, None].to(x.dtype)
        return self.comm.all_reduce(y)

    # helpers ------------------------------------------------------------------------------
    def _linear(self, prefix: str) -> QuantLinear:
        lin = self._linears.get(prefix)
        if lin is None:
            info = self.modules.get(prefix)
            if info is None:
                raise HetquantError(f"rank weights: {prefix} is not a module of this artifact")
            local = {k: self.get(f"{prefix}.{k}") for k in info.entries}
            fmt = info.fmt
            name = "bf16" if fmt is None else fmt.name
            params = (
                {}
                if fmt is None
                else {f.name: getattr(fmt, f.name) for f in dataclasses.fields(fmt)}
            )
            lin = self._linears[prefix] = QuantLinear.from_stored(
                name,
                local,
                backend=self.backend,
                params=params,
                npu_ops=self.npu_ops,
                tp_rank=self.comm.rank,
            )
        return lin

    def _gather_vocab(self, y: torch.Tensor) -> torch.Tensor:
        per = -(-self.cfg.vocab_size // self.comm.size)  # padded split, as the loader's
        pad = per - y.shape[-1]
        if pad:
            y = F.pad(y, (0, pad))
        return self.comm.all_gather_last(y)[..., : self.cfg.vocab_size]  # [..., V]

    def _computed_experts(self, layer: int) -> list[int]:
        """Logical experts whose contribution this rank adds (each counted once overall)."""
        n = self.cfg.num_experts
        if self.layout.ep_size == 1:
            return list(range(n))
        idx = self.placement.moe_index[layer]
        owned = self.layout.owned_experts(idx, n)
        slots = self.layout.expert_slots(idx, n)
        first_slot = self.layout.first_slots(idx, n)
        return sorted({e for s, e in zip(slots, owned, strict=True) if first_slot[e] == s})


def run_stage(
    model: DecoderReference,
    layers: range,
    h_or_tokens: torch.Tensor,
    *,
    first: bool,
    last: bool,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This stage's part of the forward: token ids [T] (first stage) or hidden states
    (``model.hidden_shape(T)``) in; hidden states out, or float32 logits [T, V] on the last
    stage. ``tokens``: the sequence's token ids (default: ``h_or_tokens`` on the first stage),
    for a family whose layers read them (DeepSeek-V4's hash-routed MoE)."""
    w = model.weights
    h_or_tokens = h_or_tokens.to(w.device)
    ids = (h_or_tokens if first else torch.empty(0, dtype=torch.long)) if tokens is None else tokens
    with torch.inference_mode():
        h = model.embed_hidden(h_or_tokens) if first else h_or_tokens
        ctx = model.context(ids.to(w.device), h)
        for layer in layers:
            h = model.decoder_layer(layer, h, *ctx)
        return model.head(h) if last else h
