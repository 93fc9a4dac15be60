"""``ParallelLayout``: which part of the model one rank holds.

A rank has a coordinate in each parallel dimension, given explicitly (no globals):

- **TP** ``tp_size``/``tp_rank``: column-parallel weights split their ``out`` rows, row-parallel
  ones their ``in`` columns, embeddings/heads their vocab rows (``split_of``; the family's role
  table says which is which, ``shard_rules.py`` how each format's stored tensors follow).
- **PP** ``pp_size``/``pp_rank``: contiguous stages of decoder layers; the embedding lives on the
  first stage, the final norm and ``lm_head`` (and MTP layers, when loaded) on the last. Layer
  counts follow vLLM's ``get_pp_indices``: ``L // pp`` each, and the ``L % pp`` left over go one
  each to the stages before the last, from the second-to-last backwards (61 layers, PP2 → 31 +
  30). ``pp_layers`` overrides the counts (vLLM's ``VLLM_PP_LAYER_PARTITION``).
- **EP** ``ep_size``/``ep_rank``: with ``ep_size > 1`` routed experts are never TP-split; each
  rank owns whole experts. Without a map, rank r owns the contiguous block
  ``[r·E/ep, (r+1)·E/ep)`` (DeepSeek ``convert.py``; vLLM's linear placement); E must divide.
  ``physical_to_logical`` (EPLB's ``phy2log``) gives, per MoE layer, the logical expert of
  every physical slot; rank r owns the contiguous block of slots vLLM's linear rule gives it
  (``P // ep`` slots, one more for ``r < P % ep``; EPLB itself makes P a multiple of ep) and
  loads the logical experts those slots name. Rows: one per MoE layer in layer order (MTP
  layers after the main ones when they are loaded), or a single row for every layer.
- ``attn_dp``: attention data parallel (SGLang ``--enable-dp-attention``): attention weights and
  the input embedding are replicated instead of TP-split; MLPs and ``lm_head`` still follow TP.
- ``accel_experts``: which routed experts live on this accelerator; the rest belong to the CPU
  expert pool and are not loaded. None: every routed expert the artifact's root part stores;
  N: logical experts ``0..N-1`` of every MoE layer (kt ``--kt-num-gpu-experts``); a mapping
  layer id → expert ids (e.g. the hottest); layers absent from it keep none.

Model-dependent checks (heads, expert counts, quantization groups) are in :meth:`validate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetquant.formats.errors import HetquantError

from .shard_rules import (
    DIM_NAMES,
    ModelFacts,
    ModuleInfo,
    Placement,
    place,
    shard_pieces,
    split_range,
)

__all__ = ["ParallelLayout", "check_layout", "pp_partition", "split_of"]

AccelExperts = int | Mapping[int, Sequence[int]] | tuple[tuple[int, tuple[int, ...]], ...] | None


def pp_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per stage, vLLM ``get_pp_indices`` (see the module docstring)."""
    if num_layers < pp_size:
        raise HetquantError(
            f"pp_size {pp_size} exceeds the {num_layers} decoder layers; "
            f"valid pp sizes: 1..{num_layers}"
        )
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return tuple(counts)


def _check_rank(what: str, size: int, rank: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise HetquantError(f"{what}_size must be an integer >= 1, got {size!r}")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise HetquantError(f"{what}_rank {rank!r} is outside 0..{size - 1} ({what}_size {size})")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """One rank's coordinates (see the module docstring). Validated at construction."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    attn_dp: bool = False
    physical_to_logical: tuple[tuple[int, ...], ...] | None = None
    accel_experts: AccelExperts = None
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for what in ("tp", "pp", "ep"):
            _check_rank(what, getattr(self, f"{what}_size"), getattr(self, f"{what}_rank"))
        if self.physical_to_logical is not None:
            rows = tuple(tuple(int(e) for e in row) for row in self.physical_to_logical)
            if not rows or any(not row or min(row) < 0 for row in rows):
                raise HetquantError(
                    "physical_to_logical needs at least one row, each a non-empty list of "
                    "logical expert ids >= 0 (one per physical slot)"
                )
            object.__setattr__(self, "physical_to_logical", rows)
        object.__setattr__(self, "accel_experts", _normalize_accel(self.accel_experts))
        if self.pp_layers is not None:
            counts = tuple(int(c) for c in self.pp_layers)
            if len(counts) != self.pp_size or min(counts) < 1:
                raise HetquantError(
                    f"pp_layers {list(counts)} must give {self.pp_size} stage sizes, each >= 1"
                )
            object.__setattr__(self, "pp_layers", counts)

    # -- pipeline stages -----------------------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers (ids < ``num_layers``) of this rank's pipeline stage."""
        counts = self.pp_layers or pp_partition(num_layers, self.pp_size)
        if sum(counts) != num_layers:
            raise HetquantError(
                f"pp_layers {list(counts)} sum to {sum(counts)}, but the model has {num_layers} "
                "decoder layers"
            )
        start = sum(counts[: self.pp_rank])
        return range(start, start + counts[self.pp_rank])

    # -- experts -------------------------------------------------------------------------

    def first_slots(self, moe_index: int, n_experts: int) -> dict[int, int]:
        """Logical expert → its first physical slot in MoE layer ``moe_index`` (the one replica
        whose owner adds the expert's contribution, so redundant copies count once)."""
        row = self._map_row(moe_index)
        if row is None:
            return {e: e for e in range(n_experts)}
        first: dict[int, int] = {}
        for slot, e in enumerate(row):
            first.setdefault(e, slot)
        return first

    def _map_row(self, moe_index: int) -> tuple[int, ...] | None:
        rows = self.physical_to_logical
        if rows is None:
            return None
        if len(rows) == 1:
            return rows[0]
        if moe_index >= len(rows):
            raise HetquantError(
                f"physical_to_logical has {len(rows)} rows but MoE layer #{moe_index} (counting "
                "MoE layers from 0, MTP layers last) needs one; give one row per MoE layer or one "
                "row for all"
            )
        return rows[moe_index]

    def expert_slots(self, moe_index: int, n_experts: int) -> range:
        """The physical expert slots this EP rank owns in MoE layer ``moe_index``."""
        row = self._map_row(moe_index)
        total = n_experts if row is None else len(row)
        if row is None and total % self.ep_size:
            valid = [d for d in range(1, total + 1) if total % d == 0]
            raise HetquantError(
                f"ep_size {self.ep_size} does not divide the {total} routed experts; valid ep "
                f"sizes: {', '.join(map(str, valid))} (or give physical_to_logical with redundant "
                "experts)"
            )
        base, rem = divmod(total, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, rem)
        return range(start, start + base + (self.ep_rank < rem))

    def owned_experts(self, moe_index: int, n_experts: int) -> tuple[int, ...]:
        """Logical expert of each owned physical slot, in slot order (may repeat)."""
        row = self._map_row(moe_index)
        slots = self.expert_slots(moe_index, n_experts)
        return tuple(slots) if row is None else tuple(row[s] for s in slots)

    def accel_ids(self, layer: int, n_experts: int) -> frozenset[int] | None:
        """Routed experts of ``layer`` kept on the accelerator; None: all of them."""
        accel = self.accel_experts
        if accel is None:
            return None
        if isinstance(accel, int):
            return frozenset(range(min(accel, n_experts)))
        return frozenset(dict(accel).get(layer, ()))

    def validate(self, cfg: Mapping[str, Any], modules: Mapping[str, Any]) -> None:
        """Refuse this layout for a model (config.json dict) and its stored modules.

        ``modules``: module prefix → ``shard_rules.ModuleInfo`` (``Artifact.modules``). Raises
        HetquantError naming the reason and the valid alternatives: heads or experts that do
        not divide, a split that would cut a quantization group, block, pack or tile.
        """
        check_layout(self, cfg, modules)


def _normalize_accel(accel: AccelExperts) -> AccelExperts:
    if accel is None:
        return None
    if isinstance(accel, bool) or not isinstance(accel, int | Mapping | tuple):
        raise HetquantError(
            f"accel_experts must be None, an int or a mapping layer -> expert ids, got {accel!r}"
        )
    if isinstance(accel, int):
        if accel < 0:
            raise HetquantError(f"accel_experts {accel} must be >= 0")
        return accel
    pairs = accel.items() if isinstance(accel, Mapping) else accel
    out = []
    for layer, ids in pairs:
        ids = tuple(sorted({int(e) for e in ids}))
        if ids and ids[0] < 0:
            raise HetquantError(f"accel_experts[{layer}] has negative expert ids: {list(ids)}")
        out.append((int(layer), ids))
    return tuple(sorted(out))


# -- what a layout does to a module, and whether a model fits it ------------------------------


def split_of(pl: Placement, layout: ParallelLayout) -> int | None:
    """The weight dim this layout splits the module along over TP (None: kept whole)."""
    g = pl.rule.group
    if pl.rule.dim is None or layout.tp_size == 1:
        return None
    if layout.attn_dp and (g == "attention" or (g == "embed")):
        return None
    if g == "routed" and layout.ep_size > 1:
        return None
    return pl.rule.dim


def _tp_split_ok(info: ModuleInfo, pl: Placement, dim: int, world: int) -> str | None:
    """None if every TP rank's piece is legal, else the reason."""
    size = info.shape[dim]
    if pl.rule.group not in ("embed", "head") and size % world:
        return f"{info.prefix}: {DIM_NAMES[dim]} = {size} does not split evenly {world} ways"
    try:
        for rank in range(world):
            shard_pieces(info, dim, *split_range(pl, size, world, rank))
    except HetquantError as e:
        return str(e)
    return None


_HEADS = ("heads", "KV heads")  # what ``ModelConfig.tp_head_counts`` lists


def _tp_reason(layout: ParallelLayout, facts: ModelFacts, modules: Iterable[ModuleInfo]) -> Any:
    """``reason(world)``: why ``world`` TP ranks cannot hold ``modules`` (None: they can); and
    the gcd that every valid world divides."""
    split = [
        (m, pl, d)
        for m in modules
        if (d := split_of(pl := place(m.prefix, facts.family), layout)) is not None
    ]

    def reason(world: int) -> str | None:
        bad = [h for h in facts.heads if h % world]
        if world > 1 and not layout.attn_dp and bad:
            return f"tp_size {world} does not divide {bad[0]} {_HEADS[facts.heads.index(bad[0])]}"
        seen: set[tuple] = set()
        for info, pl, dim in split:
            key = (info.fmt, info.shape, dim, pl.rule.group in ("embed", "head"))
            if key not in seen and (why := _tp_split_ok(info, pl, dim, world)):
                return f"tp_size {world}: {why}"
            seen.add(key)
        return None

    sizes = [info.shape[d] for info, pl, d in split if pl.rule.group not in ("embed", "head")]
    return reason, math.gcd(*sizes, *(() if layout.attn_dp else facts.heads))


def check_layout(
    layout: ParallelLayout, cfg: Mapping[str, Any], modules: Mapping[str, ModuleInfo]
) -> None:
    """See ``ParallelLayout.validate``."""
    facts = ModelFacts.from_config(cfg)
    layout.stage_layers(facts.num_layers)  # pp size / pp_layers against the layer count
    _check_experts(layout, facts)
    if layout.tp_size == 1:
        return
    reason, bound = _tp_reason(layout, facts, modules.values())
    if not (why := reason(layout.tp_size)):
        return
    valid = [d for d in range(1, bound + 1) if bound % d == 0 and reason(d) is None]
    msg = f"{why}; valid tp sizes: {', '.join(map(str, valid))}"
    if not layout.attn_dp:
        dp_layout = dataclasses.replace(layout, attn_dp=True)
        dp_reason, dp_bound = _tp_reason(dp_layout, facts, modules.values())
        dp = [d for d in range(1, dp_bound + 1) if dp_bound % d == 0 and dp_reason(d) is None]
        msg += f" (with attn_dp=True: {', '.join(map(str, dp))})" if dp != valid else ""
    raise HetquantError(msg)


def _check_experts(layout: ParallelLayout, facts: ModelFacts) -> None:
    e, rows = facts.n_routed, layout.physical_to_logical
    if rows is not None:
        n_main = sum(i < facts.num_layers for i in facts.moe_layers)
        if len(rows) not in (1, n_main, len(facts.moe_layers)):
            raise HetquantError(
                f"physical_to_logical has {len(rows)} rows; give 1 (every MoE layer), {n_main} "
                f"(MoE layers {facts.moe_layers[:n_main]}) or {len(facts.moe_layers)} (with MTP)"
            )
        for i, row in enumerate(rows):
            missing = sorted(set(range(e)) - set(row))
            if max(row) >= e or missing:
                raise HetquantError(
                    f"physical_to_logical row {i}: every slot must name a logical expert in "
                    f"0..{e - 1} and every expert needs a slot; bad: "
                    f"{sorted(x for x in row if x >= e)}, without a slot: {missing}"
                )
            if len(row) < layout.ep_size:
                raise HetquantError(
                    f"physical_to_logical row {i} has {len(row)} slots for ep_size "
                    f"{layout.ep_size}; every EP rank needs at least one slot"
                )
    elif layout.ep_size > 1 and facts.moe_layers:
        layout.expert_slots(0, e)  # raises with the valid ep sizes
    for layer, ids in _accel_items(layout):
        if ids and max(ids) >= e:
            raise HetquantError(f"accel_experts[{layer}] names experts >= {e}: {list(ids)}")


def _accel_items(layout: ParallelLayout) -> Iterable[tuple[int, tuple[int, ...]]]:
    accel = layout.accel_experts
    return () if accel is None or isinstance(accel, int) else accel  # type: ignore[return-value]
