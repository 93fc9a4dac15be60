"""Shard rules: tensor role × format axes → which slice of every stored tensor a rank keeps.

A module's role comes from its model family's role table (``formats/families``): ``place`` looks
the module name up there, and the role's ``tp`` column gives the weight dim tensor parallelism
splits — ``column`` and ``vocab``: out (dim 0), ``row``: in (dim 1), ``replicate``: none. The
placement's ``Rule.group`` is what the layout (``layout.py`` ``split_of``) and the loader treat
apart:

==========  ====================================================================================
group       what happens to it
==========  ====================================================================================
embed       an input embedding (kind ``embedding``): vocab rows, padded split (⌈V/tp⌉ per rank,
            vLLM's); replicated with attn_dp; the global one lives on the first PP stage
head        an output head (kind ``head``): vocab rows, padded split; on the last PP stage
routed      a routed expert: with EP > 1 owned whole by one rank, else split by TP
cpu         a layer's stacked routed experts (``cpu_experts/``): never loaded (the CPU pool's)
attention   the family's ``attention_group``: split by TP, replicated with attn_dp
(other)     the role's precision group (``norms``, ``dense_mlp``, ...): split by TP as ``tp`` says
==========  ====================================================================================

An even split needs ``size % world == 0`` and whole units of every stored key (an AWQ group, an
8-pack, an NVFP4 block or Ascend tile, an FP8 block); anything else is refused with the valid
degrees. A plain tensor (norm, embedding, BF16 copy) is its own unit-1 format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetquant.formats.base import WeightFormat
from hetquant.formats.errors import HetquantError
from hetquant.formats.families import FAMILIES, ModelFamily, Role, parse_config
from hetquant.formats.safetensors_io import HeaderEntry

__all__ = [
    "DIM_NAMES",
    "IN",
    "OUT",
    "ModelFacts",
    "ModuleInfo",
    "Piece",
    "Placement",
    "Rule",
    "place",
    "rule_of",
    "shard_pieces",
    "split_range",
]

OUT, IN = 0, 1
DIM_NAMES = ("out", "in")
_TP_DIM = {"column": OUT, "vocab": OUT, "row": IN, "replicate": None}


@dataclass(frozen=True)
class Rule:
    """How a module shards: its group (module docstring) and the weight dim TP splits."""

    group: str
    dim: int | None  # OUT (column, vocab), IN (row) or None (replicate)


def rule_of(role: Role | None, family: ModelFamily) -> Rule:
    """The rule of a role of ``family``'s table (None: a layer's stacked routed experts)."""
    if role is None:
        return Rule("cpu", None)
    if role.expert == "routed":
        group = "routed"
    elif role.kind in ("embedding", "head"):
        group = "embed" if role.kind == "embedding" else "head"
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


@dataclass(frozen=True)
class ModelFacts:
    """What sharding reads of the model: a view of config.json parsed by its family."""

    num_layers: int
    heads: tuple[int, ...]  # the head counts TP must divide (query heads; KV heads under GQA)
    n_routed: int
    moe_layers: tuple[int, ...]  # main-model MoE layers, then MTP ones
    mtp_layers: tuple[int, ...]
    family: ModelFamily

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ModelFacts:
        cfg = parse_config(raw)
        return cls(
            cfg.num_hidden_layers,
            cfg.tp_head_counts,
            cfg.num_experts,
            cfg.moe_layers,
            tuple(cfg.mtp_layer_ids),
            cfg.family,
        )


@dataclass(frozen=True)
class ModuleInfo:
    """A stored module: format (None: one plain tensor), weight shape [out, in] (plain: the
    tensor's shape) and its tensors, local key → (file, header entry)."""

    prefix: str
    fmt: WeightFormat | None
    shape: tuple[int, ...]
    entries: Mapping[str, tuple[str, HeaderEntry]]


@dataclass(frozen=True)
class Piece:
    """What a rank keeps of one stored tensor: ``view[axis][start:stop]``, reshaped to ``shape``
    (axis None: the whole tensor)."""

    view: tuple[int, ...]
    axis: int | None
    start: int
    stop: int
    shape: tuple[int, ...]


def split_range(pl: Placement, size: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of a dim of ``size`` on ``rank``: even, or padded for the vocab."""
    if pl.rule.group in ("embed", "head"):
        per = -(-size // world)  # vLLM pads the vocab: ⌈V / tp⌉ rows per rank, fewer on the last
        return min(rank * per, size), min((rank + 1) * per, size)
    per = size // world
    return rank * per, (rank + 1) * per


def _axes(info: ModuleInfo) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple]]:
    if info.fmt is None:
        (key,) = info.entries
        axes = tuple(d if d < len(info.shape) else None for d in (OUT, IN))
        return {key: info.shape}, {key: axes}
    return info.fmt.shard_view(info.shape), info.fmt.shard_axes(info.shape)  # type: ignore[arg-type]


def shard_pieces(info: ModuleInfo, dim: int | None, start: int, stop: int) -> dict[str, Piece]:
    """Each stored key's piece when the weight keeps ``[start, stop)`` along ``dim``.

    Raises HetquantError when that range cuts a unit (group, pack, block, tile) of some key.
    """
    views, axes = _axes(info)
    if dim is None:
        return {k: Piece(v, None, 0, 0, info.entries[k][1].shape) for k, v in views.items()}
    ranges = {}
    for key, view in views.items():
        axis = axes[key][dim]
        if axis is not None:
            unit = _unit(info, key, view[axis], dim)
            if start % unit or stop % unit:
                name, what = info.fmt.name if info.fmt else "plain", ("rows", "columns")[dim]
                raise HetquantError(
                    f"{info.prefix} ({name}, [out, in] = {list(info.shape)}): {DIM_NAMES[dim]} = "
                    f"{info.shape[dim]} leaves {stop - start} per rank, not a multiple of {unit} "
                    f"({key}: one entry per {unit} {what}); the split would cut a quantization unit"
                )
            ranges[key] = (axis, start // unit, stop // unit)
    shard = list(info.shape)
    shard[dim] = stop - start  # the shard's own [out, in]
    if info.fmt is None:
        finals = {k: tuple(shard) for k in views}
    else:
        finals = {k: m.shape for k, m in info.fmt.stored(tuple(shard)).items()}  # type: ignore[arg-type]
    return {k: Piece(v, *ranges.get(k, (None, 0, 0)), finals[k]) for k, v in views.items()}


def _unit(info: ModuleInfo, key: str, entries: int, dim: int) -> int:
    size = info.shape[dim]
    if entries == 0 or size % entries:
        raise HetquantError(
            f"{info.prefix}: stored {key} has {entries} entries along the weight's "
            f"{DIM_NAMES[dim]} ({size}); padded blocks cannot be split — keep it whole"
        )
    return size // entries
