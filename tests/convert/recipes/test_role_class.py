"""convert/recipes/role_class.py: the role class of every kind of tensor of the tiny DeepSeek-V3
checkpoint, and the dense MLP down_proj that ``keep_dense_down`` keeps."""

from __future__ import annotations

import pytest
from support import TINY

from hetquant.convert import SourceCheckpoint
from hetquant.convert.recipes import quantized
from hetquant.convert.recipes.role_class import dense_down, role_class

CLASSES = {
    "model.embed_tokens.weight": "embedding",
    "lm_head.weight": "embedding",
    "model.norm.weight": "norm",
    "model.layers.0.input_layernorm.weight": "norm",
    "model.layers.0.self_attn.q_a_proj.weight": "attention",
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "attention",
    "model.layers.0.self_attn.kv_b_proj.weight": "absorbed",
    "model.layers.0.mlp.gate_proj.weight": "dense",
    "model.layers.0.mlp.down_proj.weight": "dense",
    "model.layers.1.mlp.gate.weight": "router",
    "model.layers.1.mlp.gate.e_score_correction_bias": "router",
    "model.layers.1.mlp.shared_experts.down_proj.weight": "shared",
    "model.layers.1.mlp.experts.0.gate_proj.weight": "routed",
    "model.layers.3.enorm.weight": "mtp_extra",  # the tiny model's MTP layer
    "model.layers.3.eh_proj.weight": "mtp_extra",
}


@pytest.fixture(scope="module")
def roles():
    return {n: t.role for n, t in SourceCheckpoint.open(TINY).tensors.items()}


@pytest.mark.parametrize(("name", "cls"), sorted(CLASSES.items()))
def test_role_class(roles, name: str, cls: str) -> None:
    assert role_class(roles[name]) == cls


def test_dense_down_is_the_dense_layers_down_proj_only(roles) -> None:
    downs = {n for n, r in roles.items() if dense_down(role_class(r), r)}
    assert downs == {"model.layers.0.mlp.down_proj.weight"}
    shared = roles["model.layers.1.mlp.shared_experts.down_proj.weight"]
    assert not dense_down("shared", shared)  # a down_proj, but its class is not ``dense``


def test_quantized_reexports_role_class() -> None:
    assert quantized.role_class is role_class
