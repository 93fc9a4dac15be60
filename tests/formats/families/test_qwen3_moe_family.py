"""The Qwen3-MoE family: its role table against the tiny generator's hand-written names and
shapes, the config's layer rules and refusals, and its AWQ mappings."""

from __future__ import annotations

import pytest
from support import make_tiny_qwen3

from hetquant.formats import HetquantError
from hetquant.formats.families import expected_tensors, get_family, parse_config
from hetquant.formats.families.qwen3_moe import FAMILY, Qwen3MoeConfig

GEN = make_tiny_qwen3()


def _raw(**changes: object) -> dict:
    return {**GEN.CONFIG, **changes}


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_role_table_matches_the_generator(dtype: str) -> None:
    raw = _raw(**({"quantization_config": GEN.FP8_CONFIG} if dtype == "fp8" else {}))
    cfg = parse_config(raw)
    assert isinstance(cfg, Qwen3MoeConfig) and cfg.family is FAMILY is get_family("qwen3_moe")
    roles, want = expected_tensors(cfg), GEN.shapes(raw)
    assert {n: r.shape for n, r in roles.items()} == want  # same names, same shapes
    assert cfg.weight_block_size == ((128, 128) if dtype == "fp8" else None)


def test_layer_rules_and_generic_facts() -> None:
    cfg = parse_config(_raw())
    assert cfg.moe_layers == (0, 2) and cfg.num_mtp_layers == 0 and cfg.total_layers == 3
    assert cfg.layer_scopes(1) == {"layer", "dense"} and cfg.layer_scopes(2) == {"layer", "moe"}
    assert cfg.tp_head_counts == (8, 2) and cfg.head_dim == 32
    step = parse_config(_raw(mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=5))
    assert step.moe_layers == (1, 3)  # (L + 1) % step == 0, transformers' rule
    spec = cfg.router()
    assert (spec.scoring, spec.n_group, spec.use_bias, spec.scaling) == ("softmax", 1, False, 1.0)
    assert spec.top_k == 2 and spec.norm_topk_prob
    defaults = parse_config({k: v for k, v in _raw().items()
                             if k not in ("head_dim", "norm_topk_prob")})  # fmt: skip
    assert defaults.head_dim == 256 // 8 and not defaults.router().norm_topk_prob
    assert (
        FAMILY.mlp("shared") is None and FAMILY.stacked_experts(0) == "model.layers.0.mlp.experts"
    )


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        ({k: v for k, v in _raw().items() if k != "num_experts_per_tok"},
         ("origin.json", "MoE field", "num_experts_per_tok")),
        ({k: v for k, v in _raw().items() if k not in ("num_experts", "moe_intermediate_size")},
         ("num_experts", "moe_intermediate_size")),
        (_raw(num_experts=0), ("num_experts is 0", "dense Qwen3", "out of scope")),
        (_raw(model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
         ("model_type 'qwen3'", "dense Qwen3", "out of scope")),
        (_raw(model_type="qwen3_5_moe"), ("qwen3_5_moe", "linear attention")),
        (_raw(num_key_value_heads=3), ("num_attention_heads 8", "num_key_value_heads 3")),
        ({k: v for k, v in _raw().items() if k != "num_key_value_heads"},
         ("missing field", "num_key_value_heads")),
        (_raw(mlp_only_layers="1"), ("mlp_only_layers", "'1'")),
        (_raw(intermediate_size=None), ("layers [1] are dense", "intermediate_size")),
        (_raw(num_experts_per_tok=9), ("num_experts_per_tok 9",)),
        (_raw(hidden_size=True), ("hidden_size", "True")),
    ],
)  # fmt: skip
def test_config_refusals(raw: dict, needles: tuple[str, ...]) -> None:
    with pytest.raises(HetquantError) as e:
        parse_config(raw, "origin.json")
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_awq_mappings_and_refused_tensor_names() -> None:
    o = next(b for b in FAMILY.awq.balances if b.label == "o")
    assert (o.prev, o.linears) == ("v", ("o",))
    assert not o.when(parse_config(_raw()))  # GQA: 2 KV heads for 8 query heads
    assert o.when(parse_config(_raw(num_key_value_heads=8)))
    assert set(FAMILY.awq.mlp_input.linears) >= {"expert_gate", "expert_up", "dense_gate"}
    assert FAMILY.awq.mlp_input.compensate == "router"
    assert (
        FAMILY.fused_experts is not None and not FAMILY.fused_experts.transposed
    )  # read, not refused
    assert FAMILY.refusal("model.layers.0.mlp.experts.gate_up_proj") is None
