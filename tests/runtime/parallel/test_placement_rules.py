"""The placement's rules, read from the family's role table, against a frozen expectation.

The expectation was recorded from the regex table the rules used before the family registry
(``runtime/parallel/shard_rules.py`` ``RULES`` at main 377fcd4), for every module of the embedded tiny
model, of the same model with ``q_proj`` instead of ``q_a``/``q_b``, and of the real 671B layout:
what a module's placement does under three layouts (its split dim under TP 2, TP 2 with attention
data parallel, TP 2 with EP 2), its vocab split (padded or even), the loader's special groups, its
layer and expert. ``EXPECTED`` is the per-name-pattern summary; the digests cover every module.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from hetquant.formats.families import ModelConfig, expected_tensors, load_config, parse_config
from hetquant.runtime.parallel.layout import ParallelLayout
from hetquant.runtime.parallel.placement import place, split_of, split_range

REPO = Path(__file__).resolve().parents[3]
LAYOUTS = (
    ParallelLayout(tp_size=2),
    ParallelLayout(tp_size=2, attn_dp=True),
    ParallelLayout(tp_size=2, ep_size=2),
)
SPECIAL = ("embed", "head", "routed", "cpu")  # the groups the loader and layout treat apart

# pattern: (special group or "-", split dim per layout, rows of rank 3 of 4 out of 10)
EXPECTED = {
    "lm_head": ("head", (0, 0, 0), (9, 10)),
    "model.embed_tokens": ("embed", (0, None, 0), (9, 10)),
    "model.layers.{L}.eh_proj": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.embed_tokens": ("embed", (0, None, 0), (9, 10)),
    "model.layers.{L}.enorm": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.hnorm": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.input_layernorm": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.mlp.down_proj": ("-", (1, 1, 1), (6, 8)),
    "model.layers.{L}.mlp.experts": ("cpu", (None, None, None), (6, 8)),
    "model.layers.{L}.mlp.experts.{e}.down_proj": ("routed", (1, 1, None), (6, 8)),
    "model.layers.{L}.mlp.experts.{e}.gate_proj": ("routed", (0, 0, None), (6, 8)),
    "model.layers.{L}.mlp.experts.{e}.up_proj": ("routed", (0, 0, None), (6, 8)),
    "model.layers.{L}.mlp.gate": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.mlp.gate_proj": ("-", (0, 0, 0), (6, 8)),
    "model.layers.{L}.mlp.shared_experts.down_proj": ("-", (1, 1, 1), (6, 8)),
    "model.layers.{L}.mlp.shared_experts.gate_proj": ("-", (0, 0, 0), (6, 8)),
    "model.layers.{L}.mlp.shared_experts.up_proj": ("-", (0, 0, 0), (6, 8)),
    "model.layers.{L}.mlp.up_proj": ("-", (0, 0, 0), (6, 8)),
    "model.layers.{L}.post_attention_layernorm": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.self_attn.kv_a_layernorm": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.self_attn.kv_a_proj_with_mqa": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.self_attn.kv_b_proj": ("-", (0, None, 0), (6, 8)),
    "model.layers.{L}.self_attn.o_proj": ("-", (1, None, 1), (6, 8)),
    "model.layers.{L}.self_attn.q_a_layernorm": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.self_attn.q_a_proj": ("-", (None, None, None), (6, 8)),
    "model.layers.{L}.self_attn.q_b_proj": ("-", (0, None, 0), (6, 8)),
    "model.layers.{L}.self_attn.q_proj": ("-", (0, None, 0), (6, 8)),
    "model.layers.{L}.shared_head.head": ("head", (0, 0, 0), (9, 10)),
    "model.layers.{L}.shared_head.norm": ("-", (None, None, None), (6, 8)),
    "model.norm": ("-", (None, None, None), (6, 8)),
}  # fmt: skip
# model: (modules, sha256 of json.dumps([(module, group, dims, range, layer, expert), ...]))
DIGESTS = {
    "tiny-deepseek-v3": (135, "6c5743821a8f2dfa4b19783e4af4b22c9daa38fef20acff95a3056e0c386d40d"),
    "deepseek-v3-layout": (
        46183,
        "4fa28d1f25e5f3dfc923de2da7f54e27424353d9c54b3166fe185c2658cac0a9",
    ),
    "tiny-q_proj": (127, "2c0c26f51bb41aa3f59d3e454e4bf03323f53fc6a14c14bb85477d277ef599e4"),
}


def _config(model: str) -> ModelConfig:
    if model == "tiny-q_proj":
        raw = json.loads((REPO / "examples/tiny-deepseek-v3/config.json").read_text())
        return parse_config({**raw, "q_lora_rank": None})
    return load_config(REPO / "examples" / model / "config.json")


def _modules(cfg: ModelConfig) -> list[str]:
    mods = {name.rpartition(".")[0] for name in expected_tensors(cfg)}
    mods |= {cfg.family.stacked_experts(layer) for layer in cfg.moe_layers}
    return sorted(mods)


def _behaviour(module: str) -> tuple:
    pl = place(module)
    group = pl.rule.group if pl.rule.group in SPECIAL else "-"
    dims = tuple(split_of(pl, lay) for lay in LAYOUTS)
    return group, dims, split_range(pl, 10, 4, 3), pl.layer, pl.expert


@pytest.mark.parametrize("model", sorted(DIGESTS))
def test_placement_rules_match_the_frozen_expectation(model: str) -> None:
    rows = [(m, *_behaviour(m)) for m in _modules(_config(model))]
    by_pattern: dict[str, set] = {}
    for m, group, dims, rng, _, _ in rows:
        p = re.sub(r"experts\.\d+", "experts.{e}", re.sub(r"layers\.\d+", "layers.{L}", m))
        by_pattern.setdefault(p, set()).add((group, dims, rng))
    assert by_pattern == {p: {EXPECTED[p]} for p in by_pattern}
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    assert (len(rows), digest) == DIGESTS[model]
