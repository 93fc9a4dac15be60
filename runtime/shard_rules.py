"""Shard rules: tensor role × format axes → which slice of every stored tensor a rank keeps.

Roles come from HF names through the regex table ``RULES`` below (runtime may not import
``convert``, so this repeats the minimum of its role table: split dim and group). A rule gives
the weight dim that tensor parallelism splits; the format (``WeightFormat.shard_axes``) says
which dim of each stored tensor follows it, and in what unit:

========================================  =========  ==========================================
module (relative to model.layers.{L}.)     split      under
========================================  =========  ==========================================
self_attn.q_b_proj / q_proj / kv_b_proj    out (col)  TP, by heads (H·d rows, heads whole);
                                                      replicated with attn_dp
self_attn.o_proj                           in (row)   TP; replicated with attn_dp
self_attn.q_a_proj / kv_a_proj_with_mqa    —          replicated
mlp.{gate,up}_proj, shared_experts.*       out (col)  TP  (dense MLP, shared experts)
mlp.down_proj, shared_experts.down_proj    in (row)   TP
mlp.experts.{e}.{gate,up}_proj / down      out / in   EP > 1: whole experts, owned; else TP
mlp.gate (+ e_score_correction_bias),      —          replicated
norms, eh_proj (MTP)
model.embed_tokens, embed_tokens (MTP)     vocab      TP rows, padded split; attn_dp: replicated
lm_head, shared_head.head (MTP)            vocab      TP rows, padded split (⌈V/tp⌉ per rank)
mlp.experts.<stacked> (cpu_experts/)       —          never loaded (the CPU expert pool's)
========================================  =========  ==========================================

An even split needs ``size % world == 0`` and whole units of every stored key (an AWQ group, an
8-pack, an NVFP4 block or Ascend tile, an FP8 block); anything else is refused with the valid
degrees. A plain tensor (norm, embedding, BF16 copy) is its own unit-1 format.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetquant.formats.base import WeightFormat
from hetquant.formats.errors import HetquantError
from hetquant.formats.safetensors_io import HeaderEntry

if TYPE_CHECKING:
    from .layout import ParallelLayout

__all__ = [
    "RULES",
    "ModelFacts",
    "ModuleInfo",
    "Piece",
    "Placement",
    "Rule",
    "check_layout",
    "place",
    "shard_pieces",
    "split_of",
    "split_range",
]

OUT, IN = 0, 1
_DIM_NAME = ("out", "in")


@dataclass(frozen=True)
class Rule:
    """One row of the table: name pattern, group, and the weight dim TP splits."""

    pattern: str  # over the module prefix, relative to model.layers.{L}. when ``layer``
    group: str  # attention | mlp | shared | routed | router | norm | embed | head | mtp | cpu
    dim: int | None  # OUT (column, vocab), IN (row) or None (replicate)
    layer: bool = True


RULES: tuple[Rule, ...] = (
    Rule(r"model\.embed_tokens", "embed", OUT, layer=False),
    Rule(r"model\.norm", "norm", None, layer=False),
    Rule(r"lm_head", "head", OUT, layer=False),
    Rule(r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)", "attention", None),
    Rule(r"self_attn\.(q_b_proj|q_proj|kv_b_proj)", "attention", OUT),
    Rule(r"self_attn\.o_proj", "attention", IN),
    Rule(r"(input_layernorm|post_attention_layernorm|self_attn\.(q_a|kv_a)_layernorm"
         r"|enorm|hnorm|shared_head\.norm)", "norm", None),
    Rule(r"mlp\.(gate|up)_proj", "mlp", OUT),
    Rule(r"mlp\.down_proj", "mlp", IN),
    Rule(r"mlp\.shared_experts\.(gate|up)_proj", "shared", OUT),
    Rule(r"mlp\.shared_experts\.down_proj", "shared", IN),
    Rule(r"mlp\.gate", "router", None),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.(gate|up)_proj", "routed", OUT),
    Rule(r"mlp\.experts\.(?P<e>\d+)\.down_proj", "routed", IN),
    Rule(r"mlp\.experts", "cpu", None),
    Rule(r"eh_proj", "mtp", None),
    Rule(r"embed_tokens", "embed", OUT),
    Rule(r"shared_head\.head", "head", OUT),
)  # fmt: skip
_COMPILED = tuple((re.compile(r.pattern), r) for r in RULES)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Placement:
    """Where a module sits: its rule, layer (None: global) and routed expert index."""

    rule: Rule
    layer: int | None
    expert: int | None


def place(prefix: str) -> Placement:
    """The rule of module ``prefix`` (HF name without the local key)."""
    m = _LAYER.fullmatch(prefix)
    rest, layer = (m.group(2), int(m.group(1))) if m else (prefix, None)
    for pattern, rule in _COMPILED:
        if rule.layer == (layer is not None) and (hit := pattern.fullmatch(rest)):
            e = hit.groupdict().get("e")
            return Placement(rule, layer, None if e is None else int(e))
    raise HetquantError(
        f"{prefix}: not a DeepSeek-V3-family module the loader knows (runtime/shard_rules.py "
        "RULES); the artifact was made for another model"
    )


@dataclass(frozen=True)
class ModelFacts:
    """What sharding needs from config.json."""

    num_layers: int
    heads: int
    n_routed: int
    moe_layers: tuple[int, ...]  # main-model MoE layers, then MTP ones
    mtp_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelFacts:
        try:
            n, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        except (KeyError, TypeError, ValueError):
            raise HetquantError(
                "config.json lacks num_hidden_layers / num_attention_heads; not a DeepSeek-V3 "
                "config"
            ) from None
        e = int(cfg.get("n_routed_experts") or 0)
        first, freq = int(cfg.get("first_k_dense_replace", 0)), int(cfg.get("moe_layer_freq", 1))
        mtp = tuple(range(n, n + int(cfg.get("num_nextn_predict_layers") or 0)))
        moe = tuple(i for i in (*range(n), *mtp) if e and i >= first and i % freq == 0)  # HF
        return cls(n, heads, e, moe, mtp)


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
                    f"{info.prefix} ({name}, [out, in] = {list(info.shape)}): {_DIM_NAME[dim]} = "
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
            f"{_DIM_NAME[dim]} ({size}); padded blocks cannot be split — keep it whole"
        )
    return size // entries


def _tp_split_ok(info: ModuleInfo, pl: Placement, dim: int, world: int) -> str | None:
    """None if every TP rank's piece is legal, else the reason."""
    size = info.shape[dim]
    if pl.rule.group not in ("embed", "head") and size % world:
        return f"{info.prefix}: {_DIM_NAME[dim]} = {size} does not split evenly {world} ways"
    try:
        for rank in range(world):
            shard_pieces(info, dim, *split_range(pl, size, world, rank))
    except HetquantError as e:
        return str(e)
    return None


def _tp_reason(layout: ParallelLayout, facts: ModelFacts, modules: Iterable[ModuleInfo]) -> Any:
    """``reason(world)``: why ``world`` TP ranks cannot hold ``modules`` (None: they can); and
    the gcd that every valid world divides."""
    split = [
        (m, pl, d) for m in modules if (d := split_of(pl := place(m.prefix), layout)) is not None
    ]

    def reason(world: int) -> str | None:
        if world > 1 and not layout.attn_dp and facts.heads % world:
            return f"tp_size {world} does not divide {facts.heads} heads"
        seen: set[tuple] = set()
        for info, pl, dim in split:
            key = (info.fmt, info.shape, dim, pl.rule.group in ("embed", "head"))
            if key not in seen and (why := _tp_split_ok(info, pl, dim, world)):
                return f"tp_size {world}: {why}"
            seen.add(key)
        return None

    sizes = [info.shape[d] for info, pl, d in split if pl.rule.group not in ("embed", "head")]
    return reason, math.gcd(*sizes, *(() if layout.attn_dp else (facts.heads,)))


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
