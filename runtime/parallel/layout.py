"""``ParallelLayout``: one rank's coordinates; what they make it keep of a model is
``placement.py``'s answer.

A rank has a coordinate in each parallel dimension, given explicitly (no globals):

- **TP** ``tp_size``/``tp_rank``: column-parallel weights split their ``out`` rows, row-parallel
  ones their ``in`` columns, embeddings/heads their vocab rows (the family's role table says
  which is which; ``placement.py`` applies it, ``pieces.py`` carries it to every stored tensor).
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

The coordinates are checked at construction, against expert counts in :meth:`check_experts`;
against a model's heads and quantization units by ``placement.ModelPlacement.check``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetquant.formats.errors import HetquantError

__all__ = ["ParallelLayout", "pp_partition"]

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

    def check_experts(self, n_experts: int, moe_layers: Sequence[int], num_layers: int) -> None:
        """Refuse this layout's expert coordinates for a model of ``n_experts`` routed experts
        in ``moe_layers`` (main layers ``< num_layers``, then MTP ones): an EP size that does not
        divide them without a map, a map whose rows miss experts or leave a rank without a slot,
        ``accel_experts`` naming experts the model does not have."""
        rows, n_main = self.physical_to_logical, sum(i < num_layers for i in moe_layers)
        if rows is not None and len(rows) not in (1, n_main, len(moe_layers)):
            raise HetquantError(
                f"physical_to_logical has {len(rows)} rows; give 1 (every MoE layer), {n_main} "
                f"(MoE layers {tuple(moe_layers[:n_main])}) or {len(moe_layers)} (with MTP)"
            )
        for i, row in enumerate(rows or ()):
            missing = sorted(set(range(n_experts)) - set(row))
            if max(row) >= n_experts or missing:
                raise HetquantError(
                    f"physical_to_logical row {i}: every slot must name a logical expert in "
                    f"0..{n_experts - 1} and every expert needs a slot; bad: "
                    f"{sorted(x for x in row if x >= n_experts)}, without a slot: {missing}"
                )
            if len(row) < self.ep_size:
                raise HetquantError(
                    f"physical_to_logical row {i} has {len(row)} slots for ep_size "
                    f"{self.ep_size}; every EP rank needs at least one slot"
                )
        if rows is None and self.ep_size > 1 and moe_layers:
            self.expert_slots(0, n_experts)  # raises with the valid ep sizes
        accel = self.accel_experts
        for layer, ids in () if accel is None or isinstance(accel, int) else accel:  # type: ignore[union-attr]
            if ids and max(ids) >= n_experts:
                raise HetquantError(
                    f"accel_experts[{layer}] names experts >= {n_experts}: {list(ids)}"
                )


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
