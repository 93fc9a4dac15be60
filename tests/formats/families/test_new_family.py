"""A model family defined in this file alone — a Qwen3-MoE-like toy (GQA attention with q/k
norms, every layer MoE, no shared experts, no MTP) — converts with every kind of recipe, verifies,
and loads sharded, with no change to any other module.

The toy checkpoint is written by its own generator below (HF names spelled out, not derived from
the role table), so the table is checked against an independent list of names and shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hetquant.convert import SourceCheckpoint, convert, get_recipe, verify_artifact
from hetquant.formats.families import (
    AwqMappings,
    Balance,
    ModelConfig,
    ModelFamily,
    Role,
    expected_tensors,
    register_family,
    unregister_family,
)
from hetquant.formats.families.roles import GLOBAL, GLOBAL_LAST
from hetquant.formats.families.shapes import F, shape
from hetquant.runtime import ParallelLayout, open_artifact

H, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, INTER = 256, 320, 2, 4, 2, 64, 4, 256


@dataclass(frozen=True)
class ToyConfig(ModelConfig):
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int  # Qwen3-MoE's key, a field here (a property in DeepSeek-V3's config)
    moe_intermediate_size: int
    raw: dict[str, Any]
    weight_block_size: tuple[int, int] | None = None
    num_mtp_layers: int = 0

    @classmethod
    def parse(cls, raw: dict[str, Any], origin: str = "config.json") -> ToyConfig:
        keys = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")  # fmt: skip
        return cls(raw=raw, **{k: int(raw[k]) for k in keys})

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def layer_scopes(self, layer: int) -> frozenset[str]:
        return frozenset({"layer"})


def _row(name, pattern, scope, group, kind, tp, expert, shape, **kw) -> Role:  # type: ignore[no-untyped-def]
    return Role(name, pattern, scope, group, kind, tp, expert, shape, **kw)


_H, _Q, _KV = F.hidden_size, F.num_attention_heads * F.head_dim, F.num_key_value_heads * F.head_dim


TOY = ModelFamily(
    "toy_moe",
    ToyConfig,
    (
        _row("embed", "model.embed_tokens.weight", GLOBAL, "embeddings", "embedding", "vocab", None,
             shape(F.vocab_size, _H)),
        _row("final_norm", "model.norm.weight", GLOBAL, "norms", "norm", "replicate", None,
             shape(_H)),
        _row("lm_head", "lm_head.weight", GLOBAL_LAST, "embeddings", "head", "vocab", None,
             shape(F.vocab_size, _H)),
        _row("attn_norm", "input_layernorm.weight", "layer", "norms", "norm", "replicate", None,
             shape(_H)),
        _row("q", "self_attn.q_proj.weight", "layer", "attention", "linear", "column", None,
             shape(_Q, _H)),
        _row("k", "self_attn.k_proj.weight", "layer", "attention", "linear", "column", None,
             shape(_KV, _H)),
        _row("v", "self_attn.v_proj.weight", "layer", "attention", "linear", "column", None,
             shape(_KV, _H)),
        _row("q_norm", "self_attn.q_norm.weight", "layer", "norms", "norm", "replicate", None,
             shape(F.head_dim)),
        _row("k_norm", "self_attn.k_norm.weight", "layer", "norms", "norm", "replicate", None,
             shape(F.head_dim)),
        _row("o", "self_attn.o_proj.weight", "layer", "attention", "linear", "row", None,
             shape(_H, _Q)),
        _row("ffn_norm", "post_attention_layernorm.weight", "layer", "norms", "norm", "replicate",
             None, shape(_H)),
        _row("router", "mlp.gate.weight", "layer", "router", "router", "replicate", None,
             shape(F.num_experts, _H)),
        _row("expert_gate", "mlp.experts.{e}.gate_proj.weight", "layer", "routed_experts", "linear",
             "column", "routed", shape(F.moe_intermediate_size, _H), mlp="gate"),
        _row("expert_up", "mlp.experts.{e}.up_proj.weight", "layer", "routed_experts", "linear",
             "column", "routed", shape(F.moe_intermediate_size, _H), mlp="up"),
        _row("expert_down", "mlp.experts.{e}.down_proj.weight", "layer", "routed_experts", "linear",
             "row", "routed", shape(_H, F.moe_intermediate_size), mlp="down"),
    ),
    AwqMappings(
        balances=(Balance("attn_in", "attn_norm", ("q", "k", "v")),),
        clips=("q", "k", "v", "o"),
        mlp_input=Balance("mlp_in", "ffn_norm", ("expert_gate", "expert_up"), compensate="router"),
        clip_skip=("q_proj", "k_proj"),
    ),
    model_types=("toy_moe",),
    architectures=("ToyMoeForCausalLM",),
)  # fmt: skip


def write_toy_checkpoint(out: Path) -> dict[str, torch.Tensor]:
    """The toy's tiny checkpoint (config.json + one BF16 model.safetensors), names spelled out."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": rand(VOCAB, H), "model.norm.weight": rand(H)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        state |= {
            p + "input_layernorm.weight": rand(H),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.q_norm.weight": rand(HEAD_DIM),
            p + "self_attn.k_norm.weight": rand(HEAD_DIM),
            p + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": rand(H),
            p + "mlp.gate.weight": rand(EXPERTS, H),
        }
        for e in range(EXPERTS):
            state |= {
                f"{p}mlp.experts.{e}.gate_proj.weight": rand(INTER, H),
                f"{p}mlp.experts.{e}.up_proj.weight": rand(INTER, H),
                f"{p}mlp.experts.{e}.down_proj.weight": rand(H, INTER),
            }
    state["lm_head.weight"] = rand(VOCAB, H)
    out.mkdir(parents=True)
    config = {
        "architectures": ["ToyMoeForCausalLM"], "model_type": "toy_moe", "hidden_size": H,
        "vocab_size": VOCAB, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_experts": EXPERTS,
        "moe_intermediate_size": INTER,
    }  # fmt: skip
    (out / "config.json").write_text(__import__("json").dumps(config))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    register_family(TOY)
    try:
        root = tmp_path_factory.mktemp("toy") / "src"
        yield root, write_toy_checkpoint(root)
    finally:
        unregister_family(TOY.name)


def test_role_table_matches_the_generator(toy) -> None:  # type: ignore[no-untyped-def]
    root, state = toy
    src = SourceCheckpoint.open(root)
    assert src.config.family is TOY and isinstance(src.config, ToyConfig)
    roles = expected_tensors(src.config)
    assert set(roles) == set(state)
    assert all(roles[n].shape == tuple(t.shape) for n, t in state.items())


@pytest.mark.parametrize("recipe", ["bf16", "awq-w4a16", "ascend-hybrid"])
def test_converts_verifies_and_loads_sharded(toy, tmp_path: Path, recipe: str) -> None:  # type: ignore[no-untyped-def]
    root, state = toy
    out = tmp_path / recipe
    convert(SourceCheckpoint.open(root), out, get_recipe(recipe), max_shard_size=1 << 20)
    assert verify_artifact(out) == []
    art = open_artifact(out)
    ranks = [art.load(ParallelLayout(tp_size=2, tp_rank=r)) for r in range(2)]
    k = "model.layers.1.self_attn.k_proj"
    fmt = art.modules[k].fmt
    if recipe == "bf16":  # copied as stored: the TP halves are the source's halves
        assert torch.equal(torch.cat([r[f"{k}.weight"] for r in ranks]), state[f"{k}.weight"])
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(torch.cat([r[o] for r in ranks], dim=1), state[o])
    else:  # quantized: each half dequantizes to its rows of the whole weight
        whole = art.load(ParallelLayout())
        full = fmt.dequantize({key: whole[f"{k}.{key}"] for key in art.modules[k].entries})
        halves = [fmt.dequantize({key: r[f"{k}.{key}"] for key in art.modules[k].entries})
                  for r in ranks]  # fmt: skip
        assert torch.equal(torch.cat(halves), full)
        err = (full - state[f"{k}.weight"].float()).abs().max()
        assert 0 < err < 0.2 * state[f"{k}.weight"].float().abs().max()
    for r in ranks:
        assert torch.equal(
            r["model.layers.0.self_attn.q_norm.weight"],
            state["model.layers.0.self_attn.q_norm.weight"],
        )
    experts = [n for n in ranks[0] if ".mlp.experts." in n]
    if recipe == "ascend-hybrid":  # routed experts live in the CPU pool, found by the toy's table
        assert experts == []
        pool = art.cpu_expert_pool()
        assert sorted(pool.layers) == [0, 1]
        x = torch.randn(3, H)
        assert pool.expert(1, 2, x).shape == (3, H)
    else:
        assert len(experts) > 0


def test_place_asks_for_the_family_where_families_disagree(toy) -> None:  # type: ignore[no-untyped-def]
    from hetquant.formats import HetquantError
    from hetquant.runtime.parallel.placement import place

    other = dataclasses.replace(
        TOY,
        name="toy_column_o",
        config_type=type("ColumnOConfig", (ToyConfig,), {}),
        roles=tuple(dataclasses.replace(r, tp="column") if r.name == "o" else r for r in TOY.roles),
        model_types=("toy_column_o",),
    )
    register_family(other)
    try:
        o = "model.layers.0.self_attn.o_proj"
        with pytest.raises(HetquantError, match="shard it differently"):
            place(o)
        assert (place(o, other).rule.dim, place(o, TOY).rule.dim) == (0, 1)
        assert place("model.layers.0.self_attn.k_proj").rule.group == "attention"  # agreed
        with pytest.raises(HetquantError, match="not a module of model family toy_moe"):
            place("model.layers.0.self_attn.kv_b_proj", TOY)
    finally:
        unregister_family(other.name)
