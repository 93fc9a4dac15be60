"""The DeepSeek-V3 family: its role table against the embedded tiny checkpoint and the published
671B layout, its config refusals, its name lookups and its AWQ data.

The tiny model's tensors are read from the shards' headers by hand (``support.st_header``); the
671B figures are DeepSeek's own (``README_WEIGHTS.md``: 671B main + 14B MTP; the published
shapes of its projections).
"""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from support import INDEX, TINY, read_json, st_header

from hetquant.formats import HetquantError
from hetquant.formats.families import (
    FAMILIES,
    SCALE_SUFFIX,
    ModelConfig,
    expected_tensors,
    family_for_config,
    get_family,
    load_config,
    parse_config,
)
from hetquant.formats.families.deepseek_v3 import AWQ, FAMILY, ROLES, DeepseekV3Config

REPO = Path(__file__).resolve().parents[3]
LAYOUT_CONFIG = REPO / "examples" / "deepseek-v3-layout" / "config.json"


def _raw(**changes: object) -> dict:
    raw = read_json(TINY / "config.json")
    raw.update(changes)
    return raw


# ---- the role table against real checkpoints ---------------------------------------------------


def test_table_expands_to_exactly_the_tiny_checkpoint() -> None:
    cfg = load_config(TINY / "config.json")
    stored = {}
    for shard in sorted(set(read_json(TINY / INDEX)["weight_map"].values())):
        _, header = st_header(TINY / shard)
        stored.update({k: v for k, v in header.items() if k != "__metadata__"})
    want = expected_tensors(cfg)
    weights = {n: h for n, h in stored.items() if not n.endswith(SCALE_SUFFIX)}
    assert set(weights) == set(want)
    assert all(tuple(weights[n]["shape"]) == r.shape for n, r in want.items())
    scaled = {n.removesuffix(SCALE_SUFFIX) for n in stored if n.endswith(SCALE_SUFFIX)}
    assert scaled == {n for n, h in weights.items() if h["dtype"] == "F8_E4M3"}
    assert all(want[n].role.kind == "linear" for n in scaled)  # only linears are FP8


def test_table_expands_to_the_671b_layout() -> None:
    cfg = load_config(LAYOUT_CONFIG)
    roles = expected_tensors(cfg)
    assert len(roles) == 46_183  # + 45,808 FP8 scales = the 91,991 tensors of DeepSeek's index
    count = Counter(r.role.name for r in roles.values())
    assert count["expert_gate"] == count["expert_down"] == 59 * 256  # layers 3..60 and MTP 61
    assert count["dense_gate"] == 3 and count["router"] == 59 and count["shared_up"] == 59
    assert count["mtp_eh_proj"] == 1 and count["embed"] == count["lm_head"] == 1
    main = sum(math.prod(r.shape) for r in roles.values() if not r.mtp)
    mtp = sum(math.prod(r.shape) for r in roles.values() if r.mtp)
    assert (main, mtp) == (671_026_419_200, 13_463_426_304)  # "671B + 14B MTP"
    shapes = {
        "model.layers.0.self_attn.q_a_proj.weight": (1536, 7168),
        "model.layers.0.self_attn.q_b_proj.weight": (24576, 1536),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        "model.layers.0.self_attn.kv_b_proj.weight": (32768, 512),
        "model.layers.0.self_attn.o_proj.weight": (7168, 16384),
        "model.layers.2.mlp.down_proj.weight": (7168, 18432),
        "model.layers.3.mlp.gate.e_score_correction_bias": (256,),
        "model.layers.60.mlp.experts.255.down_proj.weight": (7168, 2048),
        "model.layers.61.shared_head.head.weight": (129280, 7168),
        "model.layers.61.eh_proj.weight": (7168, 14336),
    }
    assert {n: roles[n].shape for n in shapes} == shapes
    assert roles["model.layers.61.mlp.experts.0.up_proj.weight"].mtp


def test_model_order() -> None:
    """Embedding and final norm first, the layers in order (MTP last), lm_head last: the order
    the plan lays out (artifact bytes depend on it)."""
    names = list(expected_tensors(load_config(TINY / "config.json")))
    assert names[:3] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ]
    assert names[-2:] == ["model.layers.3.shared_head.head.weight", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)


def test_q_proj_variant_and_no_shared_experts() -> None:
    cfg = parse_config(_raw(q_lora_rank=None, n_shared_experts=0))
    names = set(expected_tensors(cfg))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in n or "q_b_proj" in n or "shared_experts" in n for n in names)
    assert expected_tensors(cfg)["model.layers.1.self_attn.q_proj.weight"].shape == (256, 256)


# ---- config ------------------------------------------------------------------------------------


def test_config_fields_and_derived_facts() -> None:
    cfg = load_config(TINY / "config.json")
    assert isinstance(cfg, DeepseekV3Config) and cfg.family is FAMILY
    assert (cfg.num_experts, cfg.num_mtp_layers, cfg.total_layers) == (8, 1, 4)
    assert cfg.moe_layers == (1, 2, 3) and list(cfg.mtp_layer_ids) == [3]
    assert cfg.weight_block_size == (128, 128) and cfg.rms_norm_eps == 1e-6
    assert cfg.router().top_k == 2 and cfg.router().use_bias
    assert ModelConfig.from_dict(cfg.raw) == cfg == DeepseekV3Config.from_dict(cfg.raw)
    no_mtp = DeepseekV3Config.without_mtp(cfg.raw)
    assert parse_config(no_mtp).num_mtp_layers == 0 and cfg.raw["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        ({k: v for k, v in _raw().items() if k not in ("hidden_size", "v_head_dim")},
         ("origin.json", "hidden_size", "v_head_dim")),
        (_raw(num_hidden_layers="3"), ("origin.json", "num_hidden_layers", "'3'")),
        (_raw(kv_lora_rank=True), ("kv_lora_rank", "True")),
        (_raw(n_routed_experts=-1), ("n_routed_experts", "-1")),
        (_raw(rms_norm_eps="small"), ("rms_norm_eps", "small")),
        ({k: v for k, v in _raw().items() if k != "model_type"},
         ("origin.json", "no model_type", "deepseek_v3")),
        (_raw(model_type=""), ("origin.json", "no model_type")),
        (_raw(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"]),
         ("origin.json", "glm4_moe", "Glm4MoeForCausalLM", "deepseek_v3", "qwen3_moe")),
    ],
)  # fmt: skip
def test_config_refusals(raw: dict, needles: tuple[str, ...]) -> None:
    with pytest.raises(HetquantError) as e:
        parse_config(raw, "origin.json")
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_router_refusals() -> None:
    cfg = parse_config(_raw(topk_group=3))
    with pytest.raises(HetquantError, match="topk_group 3 not in"):
        cfg.router()
    raw = _raw()
    del raw["topk_method"]
    with pytest.raises(HetquantError, match="lacks topk_method"):
        parse_config(raw).router()


def test_load_config_refusals(tmp_path: Path) -> None:
    with pytest.raises(HetquantError, match=r"no config\.json"):
        load_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(HetquantError, match="expected a JSON object"):
        load_config(tmp_path / "config.json")


# ---- registry ----------------------------------------------------------------------------------


def test_registry_lookup() -> None:
    assert FAMILIES["deepseek_v3"] is FAMILY is get_family("deepseek_v3")
    assert family_for_config({"model_type": "deepseek_v3"}) is FAMILY
    # Kimi K2 ships its own model_type with DeepSeek-V3's architecture and tensor names
    kimi = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert family_for_config(kimi) is FAMILY
    with pytest.raises(HetquantError, match="unknown model family 'nope'; known: deepseek_v3"):
        get_family("nope")


def test_family_is_registered_once() -> None:
    from hetquant.formats.families import register_family

    with pytest.raises(RuntimeError, match="registered twice"):
        register_family(FAMILY)


# ---- names -------------------------------------------------------------------------------------


def test_names_by_role_and_back() -> None:
    cfg = load_config(LAYOUT_CONFIG)
    assert FAMILY.tensor("embed") == "model.embed_tokens.weight"
    assert FAMILY.tensor("expert_down", 7, 12) == "model.layers.7.mlp.experts.12.down_proj.weight"
    assert FAMILY.module("q_a", 0) == "model.layers.0.self_attn.q_a_proj"
    assert FAMILY.mlp_modules("shared", 4) == tuple(
        f"model.layers.4.mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")
    )
    assert FAMILY.stacked_experts(5) == "model.layers.5.mlp.experts"
    for name, tr in expected_tensors(cfg).items():
        loc = FAMILY.locate(name.rpartition(".")[0])
        assert loc is not None and loc.role is not None, name
        assert (loc.layer, loc.expert) == (tr.layer, tr.expert), name
        assert loc.role.module == tr.role.module, name  # router and its bias share a module
        assert tr.stack == (FAMILY.stacked_experts(tr.layer) if tr.expert is not None else None)
    assert FAMILY.locate("model.layers.5.mlp.experts").role is None
    for unknown in ("model.layers.0.self_attn.rotary_emb", "model.layers.x.mlp.gate", "norm"):
        assert FAMILY.locate(unknown) is None


# ---- AWQ data ----------------------------------------------------------------------------------


def test_awq_mappings_name_roles_of_the_table() -> None:
    roles = {r.name: r for r in ROLES}
    for b in (*AWQ.balances, AWQ.mlp_input):
        assert b.prev in roles and roles[b.prev].kind in ("norm", "linear"), b
        assert all(roles[r].kind == "linear" for r in b.linears), b
    assert all(roles[r].kind == "linear" for r in AWQ.clips)
    assert AWQ.mlp_input.compensate == "router"
    assert [(m.expert, m.gate, m.down) for m in FAMILY.mlps] == [
        (None, "dense_gate", "dense_down"),
        ("shared", "shared_gate", "shared_down"),
        ("routed", "expert_gate", "expert_down"),
    ]


def test_o_fold_rows_leave_attention_unchanged() -> None:
    """Dividing kv_b_proj's rows ``_v_rows`` by s and multiplying o_proj's columns by s leaves
    the attention output unchanged (the ``fold_o_proj`` mapping is exact)."""
    from hetquant.runtime.forward.model import DeepseekV3Reference, DenseWeights

    raw = copy.deepcopy(_raw())
    raw.pop("quantization_config")
    cfg = parse_config(raw)
    gen = torch.Generator().manual_seed(0)
    state = {
        n: torch.randn(r.shape, generator=gen, dtype=torch.float64) / math.sqrt(r.shape[-1])
        for n, r in expected_tensors(cfg).items()
        if r.layer == 0
    }
    (o_fold,) = [b for b in AWQ.balances if b.option == "fold_o_proj"]
    rows = o_fold.rows(cfg)
    assert rows.shape == (cfg.num_attention_heads * cfg.v_head_dim,)
    s = torch.rand(rows.numel(), generator=gen, dtype=torch.float64) + 0.5
    folded = dict(state)
    kv_b, o = FAMILY.tensor("kv_b", 0), FAMILY.tensor("o", 0)
    folded[kv_b] = state[kv_b].clone()
    folded[kv_b][rows] /= s[:, None]
    folded[o] = state[o] * s[None, :]
    x = torch.randn(5, cfg.hidden_size, generator=gen, dtype=torch.float64)

    def attention(st: dict) -> torch.Tensor:
        model = DeepseekV3Reference(cfg, DenseWeights(st, FAMILY), dtype=torch.float64)
        cos, sin, mask = model.positions(x)
        return model.attention(0, x, cos.double(), sin.double(), mask.double())

    ref, got = attention(state), attention(folded)
    assert not torch.equal(folded[kv_b], state[kv_b])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_layout_config_is_the_published_one() -> None:
    """The layout's config.json is DeepSeek's (a guard for the figures above)."""
    raw = json.loads(LAYOUT_CONFIG.read_text())
    assert (raw["hidden_size"], raw["n_routed_experts"], raw["num_hidden_layers"]) == (
        7168,
        256,
        61,
    )
