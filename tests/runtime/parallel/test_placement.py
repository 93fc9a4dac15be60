"""The placement: the role table read once per module, the groups as data, and the counts the
loader relies on — config.json parsed once per artifact, every stored module placed once, however
many layouts are loaded or a forward runs (instrumented here, not in the code)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.formats.families.base import ModelFamily
from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.parallel import placement
from hetquant.runtime.parallel.placement import Group, Placement, Rule, place, split_of, split_range
from hetquant.runtime.serving.run import local_model


# ---- role table ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefix", "group", "dim", "layer", "expert"),
    [
        ("model.embed_tokens", "embed", 0, None, None),
        ("lm_head", "head", 0, None, None),
        ("model.norm", "norms", None, None, None),
        ("model.layers.7.self_attn.q_a_proj", "attention", None, 7, None),
        ("model.layers.7.self_attn.q_b_proj", "attention", 0, 7, None),
        ("model.layers.7.self_attn.kv_a_proj_with_mqa", "attention", None, 7, None),
        ("model.layers.7.self_attn.kv_b_proj", "attention", 0, 7, None),
        ("model.layers.7.self_attn.o_proj", "attention", 1, 7, None),
        ("model.layers.7.self_attn.kv_a_layernorm", "norms", None, 7, None),
        ("model.layers.0.mlp.up_proj", "dense_mlp", 0, 0, None),
        ("model.layers.0.mlp.down_proj", "dense_mlp", 1, 0, None),
        ("model.layers.3.mlp.shared_experts.gate_proj", "shared_experts", 0, 3, None),
        ("model.layers.3.mlp.gate", "router", None, 3, None),
        ("model.layers.3.mlp.experts.255.down_proj", "routed", 1, 3, 255),
        ("model.layers.3.mlp.experts.17.gate_proj", "routed", 0, 3, 17),
        ("model.layers.3.mlp.experts", "cpu", None, 3, None),
        ("model.layers.61.eh_proj", "mtp", None, 61, None),
        ("model.layers.61.embed_tokens", "embed", 0, 61, None),
        ("model.layers.61.shared_head.head", "head", 0, 61, None),
        ("model.layers.61.shared_head.norm", "mtp", None, 61, None),
    ],
)
def test_roles(prefix: str, group: str, dim: int | None, layer: int | None, expert) -> None:
    pl = place(prefix)
    assert (pl.rule.group, pl.rule.dim, pl.layer, pl.expert) == (group, dim, layer, expert)


def test_unknown_module_refused() -> None:
    with pytest.raises(HetquantError, match="not a module of model family deepseek_v3"):
        place("model.layers.0.self_attn.rotary_emb")


# ---- groups are data ----------------------------------------------------------------------------
def test_a_new_group_is_a_row_of_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    def vision() -> Placement:  # a global module of a made-up group, placed (as at open)
        return Placement(Rule("vision", 0), None, None)

    tp2 = [ParallelLayout(tp_size=2, tp_rank=r, attn_dp=True) for r in range(2)]
    assert [split_of(vision(), lay) for lay in tp2] == [0, 0]  # a plain group: split, even
    assert split_range(vision(), 10, 4, 3) == (6, 8)
    monkeypatch.setitem(placement.GROUPS, "vision", Group(padded=True, dp_replicated=True))
    assert [split_of(vision(), lay) for lay in tp2] == [None, None]
    assert split_range(vision(), 10, 4, 3) == (9, 10)
    assert split_of(vision(), ParallelLayout(tp_size=2)) == 0


# ---- counts: parsed once, placed once -----------------------------------------------------------
@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Counter]:
    """(origins of every config parse, module → times its family's role table was searched)."""
    parses: list[str] = []
    located: Counter = Counter()
    parse, locate = ModelFamily.parse_config, ModelFamily.locate

    def counting_parse(self, raw, origin="config.json"):  # type: ignore[no-untyped-def]
        parses.append(origin)
        return parse(self, raw, origin)

    def counting_locate(self, module):  # type: ignore[no-untyped-def]
        located[module] += 1
        return locate(self, module)

    monkeypatch.setattr(ModelFamily, "parse_config", counting_parse)
    monkeypatch.setattr(ModelFamily, "locate", counting_locate)
    return parses, located


def test_config_parsed_once_and_modules_placed_once_per_artifact(
    tiny_artifact: Path, counted: tuple[list[str], Counter]
) -> None:
    parses, located = counted
    art = open_artifact(tiny_artifact)
    layouts = [ParallelLayout(tp_size=2, tp_rank=r) for r in range(2)]
    layouts += [ParallelLayout(pp_size=2, pp_rank=1), ParallelLayout(tp_size=2, attn_dp=True)]
    for lay in layouts:
        assert art.load(lay)
    assert parses == [str(tiny_artifact / "config.json")]
    prefixes = {info.prefix for info in art.modules.values()}
    assert len(prefixes) > 100 and located == Counter(prefixes)  # each once, over 4 loads


def test_a_forward_places_nothing(tiny_artifact: Path, counted: tuple[list[str], Counter]) -> None:
    parses, located = counted
    model = local_model(tiny_artifact)
    before = (len(parses), sum(located.values()))
    assert before[0] == 1
    logits = model.forward(torch.tensor([1, 2, 3]))
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()
    assert (len(parses), sum(located.values())) == before


def test_a_module_the_artifact_does_not_store_is_named(tiny_artifact: Path) -> None:
    art = open_artifact(tiny_artifact)
    with pytest.raises(HetquantError, match=r"layers\.9\.mlp\.up_proj: not a module this"):
        art.placement.role("model.layers.9.mlp.up_proj")
