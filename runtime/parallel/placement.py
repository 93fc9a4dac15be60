"""Placement: which bytes of which stored tensor one rank keeps — the one place where a
``ParallelLayout`` (layout.py: a rank's coordinates) meets a model.

``ModelPlacement(cfg, modules)`` is built once per artifact, from its config.json parsed once
(``ModelConfig``) and its stored modules: each module is looked up in its family's role table
once (``place``: the role's group, the weight dim TP splits, layer, routed expert). For a layout,
``check`` refuses what the model does not allow, naming the valid sizes, and ``reads`` walks the
modules once:

1. **kept?** A global module sits on the first PP stage (``embed``) or the last (the rest); a
   layer's on its stage, MTP layers on the last one when asked for; a routed expert only if
   ``accel_experts`` keeps it on the accelerator and the EP rank owns one of its physical slots
   (EPLB's redundant experts included); a layer's stacked experts (``cpu``) never.
2. **split?** ``split_of``: the role's TP dim (``column``/``vocab``: out, ``row``: in), except
   attention and the input embedding under attention data parallel and routed experts under EP;
   ``split_range``: even, or the vocab padded as vLLM pads it (⌈V/tp⌉ rows per rank).
3. **bytes**: every stored key follows the split through its format (``pieces.py``) to one
   ``Span`` of file bytes.

What each group gets apart from its TP dim is data (``GROUPS``); a family's roles map to groups
by their columns (``rule_of``), so a new family adds rows to its role table, not code here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hetquant.formats.errors import HetquantError
from hetquant.formats.families import FAMILIES, ModelConfig, ModelFamily, Role

from .layout import ParallelLayout
from .pieces import DIM_NAMES, IN, OUT, ModuleInfo, TensorRead, shard_pieces

__all__ = [
    "GROUPS",
    "Group",
    "ModelPlacement",
    "Placement",
    "Rule",
    "place",
    "rule_of",
    "split_of",
    "split_range",
]

_TP_DIM = {"column": OUT, "vocab": OUT, "row": IN, "replicate": None}


@dataclass(frozen=True)
class Group:
    """What the placement does to a group's modules besides the role's TP dim."""

    first_stage: bool = False  # a global module of the first PP stage (else of the last)
    padded: bool = False  # vocab rows: ⌈V/tp⌉ per rank, the last rank's fewer
    dp_replicated: bool = False  # replicated under attention data parallel
    expert: bool = False  # a routed expert: accel_experts filters it, EP owns it whole
    loaded: bool = True  # False: another part's (the CPU expert pool's stacked experts)


GROUPS: dict[str, Group] = {
    "embed": Group(first_stage=True, padded=True, dp_replicated=True),  # kind ``embedding``
    "head": Group(padded=True),  # kind ``head``
    "routed": Group(expert=True),  # expert ``routed``
    "cpu": Group(loaded=False),  # a layer's stacked routed experts (``cpu_experts/``)
    "attention": Group(dp_replicated=True),  # the family's ``attention_group``
}
_PLAIN = Group()  # any other precision group (norms, dense_mlp, shared_experts, ...)
_GROUP_OF_KIND = {"embedding": "embed", "head": "head"}


@dataclass(frozen=True)
class Rule:
    """How a module shards: its group and the weight dim TP splits."""

    group: str
    dim: int | None  # OUT (column, vocab), IN (row) or None (replicate)

    @cached_property
    def treat(self) -> Group:
        """The group's row of ``GROUPS`` (read once per rule)."""
        return GROUPS.get(self.group, _PLAIN)


def rule_of(role: Role | None, family: ModelFamily) -> Rule:
    """The rule of a role of ``family``'s table (None: a layer's stacked routed experts)."""
    if role is None:
        return Rule("cpu", None)
    if role.expert == "routed":
        group = "routed"
    elif role.kind in _GROUP_OF_KIND:
        group = _GROUP_OF_KIND[role.kind]
    elif role.group == family.attention_group:
        group = "attention"
    else:
        group = role.group
    return Rule(group, _TP_DIM[role.tp])


@dataclass(frozen=True)
class Placement:
    """Where a module sits: its rule, layer (None: global) and routed expert index."""

    rule: Rule
    layer: int | None
    expert: int | None


def place(prefix: str, family: ModelFamily | None = None) -> Placement:
    """The placement of module ``prefix`` (HF name without the local key) in ``family``'s role
    table; without a family, in every registered family's (which must agree)."""
    found = {
        Placement(rule_of(loc.role, fam), loc.layer, loc.expert)
        for fam in ((family,) if family is not None else FAMILIES.values())
        if (loc := fam.locate(prefix)) is not None
    }
    if len(found) == 1:
        return found.pop()
    names = family.name if family is not None else ", ".join(sorted(FAMILIES))
    if not found:
        raise HetquantError(
            f"{prefix}: not a module of model family {names} (no row of its role table in "
            "formats/families/ names it); the artifact was made for another model"
        )
    raise HetquantError(f"{prefix}: model families {names} shard it differently; name the family")


def split_of(pl: Placement, layout: ParallelLayout) -> int | None:
    """The weight dim this layout splits the module along over TP (None: kept whole)."""
    treat = pl.rule.treat
    if pl.rule.dim is None or layout.tp_size == 1:
        return None
    if (layout.attn_dp and treat.dp_replicated) or (treat.expert and layout.ep_size > 1):
        return None
    return pl.rule.dim


def split_range(pl: Placement, size: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of a dim of ``size`` on ``rank``: even, or padded for the vocab."""
    if pl.rule.treat.padded:
        per = -(-size // world)  # vLLM pads the vocab: ⌈V / tp⌉ rows per rank, fewer on the last
        return min(rank * per, size), min((rank + 1) * per, size)
    per = size // world
    return rank * per, (rank + 1) * per


class ModelPlacement:
    """Every stored module of one model, placed once (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, modules: Mapping[str, ModuleInfo]) -> None:
        self.cfg, self.modules, self.family = cfg, modules, cfg.family
        prefixes = dict.fromkeys(info.prefix for info in modules.values())  # extras share one
        by_prefix = {prefix: place(prefix, self.family) for prefix in prefixes}
        self.roles = {mid: by_prefix[info.prefix] for mid, info in modules.items()}
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}

    def role(self, module: str) -> Placement:
        """The placement of stored module ``module`` (a module id of ``modules``)."""
        try:
            return self.roles[module]
        except KeyError:
            raise HetquantError(f"{module}: not a module this artifact stores") from None

    def reads(self, layout: ParallelLayout, *, mtp: bool = False) -> list[TensorRead]:
        """This rank's reads, in file order, after ``check``; ``mtp`` adds the MTP layers."""
        self.check(layout)
        keep = self._keeper(layout, mtp)
        reads = []
        for mid, info in self.modules.items():
            pl = self.roles[mid]
            if not keep(pl):
                continue
            dim, bounds = split_of(pl, layout), None
            if dim is None:
                pieces = shard_pieces(info, None, 0, 0)
            else:
                rng = split_range(pl, info.shape[dim], layout.tp_size, layout.tp_rank)
                pieces = shard_pieces(info, dim, *rng)
                cols = info.shape[1] if len(info.shape) > 1 else 1  # a 1-D tensor (V4's sinks)
                bounds = (rng, (0, cols)) if dim == OUT else ((0, info.shape[0]), rng)
            for key, piece in pieces.items():
                file, entry = info.entries[key]
                span = piece.span(entry)
                reads.append(
                    TensorRead(entry.name, mid, file, entry.dtype, piece.shape, span, bounds)
                )
        return sorted(reads, key=lambda r: (r.file, r.span.start))

    def _keeper(self, layout: ParallelLayout, mtp: bool) -> Callable[[Placement], bool]:
        """``keep(placement)``: whether this rank loads the module (step 1 of the docstring)."""
        cfg, stage = self.cfg, set(layout.stage_layers(self.cfg.num_hidden_layers))
        owned: dict[int, tuple[int, ...]] = {}  # MoE layer → logical experts of the rank's slots

        def keep(pl: Placement) -> bool:
            treat = pl.rule.treat
            if not treat.loaded:
                return False
            if pl.layer is None:
                return layout.is_first_stage if treat.first_stage else layout.is_last_stage
            if pl.layer >= cfg.num_hidden_layers:
                if not (mtp and layout.is_last_stage):
                    return False
            elif pl.layer not in stage:
                return False
            if not treat.expert:
                return True
            ids = layout.accel_ids(pl.layer, cfg.num_experts)
            if ids is not None and pl.expert not in ids:
                return False
            if pl.layer not in self.moe_index:
                raise HetquantError(
                    f"config.json makes layer {pl.layer} dense, but it stores experts"
                )
            if pl.layer not in owned:
                owned[pl.layer] = layout.owned_experts(self.moe_index[pl.layer], cfg.num_experts)
            return pl.expert in owned[pl.layer]

        return keep

    # -- whether the model fits the layout -------------------------------------------------

    def check(self, layout: ParallelLayout) -> None:
        """Refuse ``layout`` for this model: a pp size or partition the layers do not allow,
        experts that do not divide or a map that misses some, ``accel_experts`` naming experts
        the root part does not store, heads that do not divide, a split that would cut a
        quantization group, block, pack or tile; the message names the valid alternatives."""
        cfg = self.cfg
        layout.stage_layers(cfg.num_hidden_layers)
        layout.check_experts(cfg.num_experts, tuple(self.moe_index), cfg.num_hidden_layers)
        if layout.tp_size > 1:
            self._check_tp(layout)
        self._check_accel(layout)

    def _check_tp(self, layout: ParallelLayout) -> None:
        reason, bound = self._tp_reason(layout)
        if not (why := reason(layout.tp_size)):
            return
        valid = [d for d in range(1, bound + 1) if bound % d == 0 and reason(d) is None]
        msg = f"{why}; valid tp sizes: {', '.join(map(str, valid))}"
        if not layout.attn_dp:
            dp_reason, dp_bound = self._tp_reason(dataclasses.replace(layout, attn_dp=True))
            dp = [d for d in range(1, dp_bound + 1) if dp_bound % d == 0 and dp_reason(d) is None]
            msg += f" (with attn_dp=True: {', '.join(map(str, dp))})" if dp != valid else ""
        raise HetquantError(msg)

    def _tp_reason(self, layout: ParallelLayout) -> tuple[Any, int]:
        """``reason(world)``: why ``world`` TP ranks cannot hold the modules (None: they can);
        and the gcd that every valid world divides."""
        heads = self.cfg.tp_head_counts
        # modules that split alike (format, shape, dim, padding) pass or fail alike: the first of
        # each kind stands for the rest (Qwen3-235B's 36,474 split modules at fp4 are 6 kinds)
        kinds: dict[tuple, tuple[ModuleInfo, Placement, int]] = {}
        for mid, info in self.modules.items():
            if (d := split_of(pl := self.roles[mid], layout)) is not None:
                kinds.setdefault((info.fmt, info.shape, d, pl.rule.treat.padded), (info, pl, d))

        def reason(world: int) -> str | None:
            bad = [h for h in heads if h % world]
            if world > 1 and not layout.attn_dp and bad:
                kind = ("heads", "KV heads")[heads.index(bad[0])]  # as ``tp_head_counts`` lists
                return f"tp_size {world} does not divide {bad[0]} {kind}"
            for info, pl, dim in kinds.values():
                if why := _tp_split_ok(info, pl, dim, world):
                    return f"tp_size {world}: {why}"
            return None

        sizes = {info.shape[d] for info, pl, d in kinds.values() if not pl.rule.treat.padded}
        return reason, math.gcd(*sizes, *(() if layout.attn_dp else heads))

    def _check_accel(self, layout: ParallelLayout) -> None:
        """Refuse ``accel_experts`` asking for routed experts the root part does not store."""
        e, moe = self.cfg.num_experts, self.cfg.moe_layers
        stored = {pl.layer for pl in self.roles.values() if pl.rule.treat.expert}
        stage = layout.stage_layers(self.cfg.num_hidden_layers)
        for layer in sorted(set(stage) & set(moe) - stored):
            if want := layout.accel_ids(layer, e):
                raise HetquantError(
                    f"accel_experts puts experts {sorted(want)[:8]} of layer {layer} on the "
                    "accelerator, but the artifact's root part stores no routed experts of that "
                    "layer (the CPU expert pool has them: cpu_experts/); use accel_experts=0"
                )


def _tp_split_ok(info: ModuleInfo, pl: Placement, dim: int, world: int) -> str | None:
    """None if every TP rank's piece is legal, else the reason."""
    size = info.shape[dim]
    if not pl.rule.treat.padded and size % world:
        return f"{info.prefix}: {DIM_NAMES[dim]} = {size} does not split evenly {world} ways"
    try:
        for rank in range(world):
            shard_pieces(info, dim, *split_range(pl, size, world, rank))
    except HetquantError as e:
        return str(e)
    return None
