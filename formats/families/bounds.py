"""A config's counts against the names an index holds, before any name is expanded.

``ModelFamily.expected_tensors`` expands the role table into one name per tensor: layers × roles,
× experts for routed ones. config.json is untrusted (issue #25 §3): one that claims 10⁶ experts
or 10⁵ layers makes that expansion take gigabytes and minutes before any check runs. Every name
the expansion yields is a tensor the checkpoint must store (at least one stored name each: a
formatted module stores its weight and its scales or packed codes beside it), so the index bounds
it. ``check_index_holds`` compares, cheapest first and in time linear in the index:

1. the decoder layers (``total_layers``: main + MTP) and the routed experts per MoE layer, each
   at most the number of names in the index (every layer and every expert holds a tensor);
2. the same counts against the layer and expert ids the index's names actually carry (through
   ``ModelFamily.locate``): a config claiming more than the checkpoint has is refused, naming both;
3. the number of names the expansion would yield, computed per layer without expanding experts,
   at most the number of names in the index.

Before them, a name the family refuses (``ModelFamily.refusal``: a layout it does not read, such as
fused 3-D experts, whose one tensor stands for every expert) is refused with its own reason.

A family's fused 3-D experts (``ModelFamily.fused_experts``): one stored tensor stands for every
expert of its layer, so the index bounds no expert count; the expert checks (1's and 2's experts,
3) are left to ``fused_experts.unfuse``, which requires each fused tensor's stored shape — bytes
the shard holds — to be the config's ``E`` before any name is expanded. The layer checks stay.

A config claiming *fewer* layers or experts than the index holds is left to the role matching
(``convert/planning/roles.py``), which names the first tensor no role takes.
"""

from __future__ import annotations

from collections.abc import Collection

from ..errors import HetquantError
from .base import ModelConfig
from .roles import GLOBAL, GLOBAL_LAST

__all__ = ["check_index_holds", "expected_count"]


def _seen_ids(cfg: ModelConfig, names: Collection[str]) -> tuple[int, int]:
    """(highest layer id, highest routed-expert id) the index's names carry; -1 when none."""
    layer = expert = -1
    for name in names:
        if (hit := cfg.family.locate(name.rpartition(".")[0])) is None:
            continue
        layer = max(layer, -1 if hit.layer is None else hit.layer)
        expert = max(expert, -1 if hit.expert is None else hit.expert)
    return layer, expert


def _holds_fused(cfg: ModelConfig, names: Collection[str]) -> bool:
    """Whether a name is one of the family's fused expert tensors (a leaf it declares under a
    layer's stacked expert module)."""
    layout = cfg.family.fused_experts
    if layout is None:
        return False
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf in (layout.gate_up, layout.down):
            hit = cfg.family.locate(module)
            if hit is not None and hit.role is None and hit.layer is not None:
                return True
    return False


def expected_count(cfg: ModelConfig) -> int:
    """How many names ``expected_tensors(cfg)`` yields, counted per layer (time linear in the
    layers, not in layers × experts)."""
    family, count = cfg.family, 0
    count += sum(1 for r in family.roles if r.scope in (GLOBAL, GLOBAL_LAST))
    for layer in range(cfg.total_layers):
        roles = family.layer_roles(cfg, layer)
        count += sum(cfg.num_experts if r.expert == "routed" else 1 for r in roles)
    return count


def _disagree(origin: str, claim: str, held: str) -> HetquantError:
    return HetquantError(
        f"config.json claims {claim}, but {origin} {held}; config.json does not belong to this "
        "checkpoint — use the config.json published with its weights"
    )


def check_index_holds(cfg: ModelConfig, names: Collection[str], origin: str) -> None:
    """Refuse ``cfg`` when the index ``origin`` (its tensor ``names``) cannot hold what it claims
    (module docstring); time and memory linear in ``len(names)``, whatever the config says."""
    for name in names:  # a layout the family does not read: its own reason, not a count
        if (why := cfg.family.refusal(name)) is not None:
            raise HetquantError(f"tensor {name!r}: {why}")
    fused = _holds_fused(cfg, names)
    n, layers = len(names), cfg.total_layers
    what = f"{layers} decoder layers ({cfg.num_hidden_layers} + {cfg.num_mtp_layers} MTP)"
    if layers > n:
        raise _disagree(origin, what, f"names only {n} tensors")
    if cfg.num_experts > n and not fused:
        raise _disagree(origin, f"{cfg.num_experts} routed experts", f"names only {n} tensors")
    top_layer, top_expert = _seen_ids(cfg, names)
    if layers > top_layer + 1:
        held = f"names layers 0..{top_layer} only" if top_layer >= 0 else "names no layer"
        raise _disagree(origin, what, held)
    if cfg.moe_layers and cfg.num_experts > top_expert + 1 and not fused:
        held = f"names experts 0..{top_expert} only" if top_expert >= 0 else "names no expert"
        raise _disagree(origin, f"{cfg.num_experts} routed experts per MoE layer", held)
    if not fused and (count := expected_count(cfg)) > n:
        raise _disagree(origin, f"{count:,} tensors (its layers × roles × experts)", f"names {n:,}")
