"""The one table of DeepSeek-V3-family tensor roles.

Every tensor of a checkpoint is named here by a row: its name pattern (relative to
``model.layers.{L}.`` for layer tensors), role, precision group, kind, tensor-parallel split
(``column``: dim 0 of [out, in]; ``row``: dim 1; ``replicate``; ``vocab``: dim 0 of an
embedding/head; ``expert``: owned by an expert-parallel rank or split by intermediate dim), expert
kind and the expected shape as a function of the config. ``expected_tensors(cfg)`` expands the table
for a given config into every tensor name the checkpoint must contain — layer ids, the MTP layer and
the dense/MoE split all come from config.json, never from literals. Scales of FP8 weights
(``<weight>_scale_inv``) are partners, not rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetquant.formats.model_config import ModelConfig

__all__ = ["ROLES", "SCALE_SUFFIX", "Role", "TensorRole", "expected_tensors"]

SCALE_SUFFIX = "_scale_inv"
Shape = Callable[[ModelConfig], tuple[int, ...]]


@dataclass(frozen=True)
class Role:
    """One row of the table."""

    name: str
    pattern: str  # "{e}" stands for the routed expert index
    scope: str  # global | layer | attn_q_lora | attn_q | dense | moe | mtp
    group: str  # precision-table group
    kind: str  # linear | norm | embedding | router | bias
    tp: str  # column | row | replicate | vocab | expert
    expert: str | None  # None | shared | routed
    shape: Shape


def _h(c: ModelConfig) -> int:
    return c.hidden_size


def _shared_i(c: ModelConfig) -> int:
    return c.moe_intermediate_size * c.n_shared_experts


ROLES: tuple[Role, ...] = (
    # global
    Role("embed", "model.embed_tokens.weight", "global", "embeddings", "embedding", "vocab", None,
         lambda c: (c.vocab_size, _h(c))),
    Role("final_norm", "model.norm.weight", "global", "norms", "norm", "replicate", None, lambda c: (_h(c),)),
    Role("lm_head", "lm_head.weight", "global", "embeddings", "embedding", "vocab", None,
         lambda c: (c.vocab_size, _h(c))),
    # every layer
    Role("attn_norm", "input_layernorm.weight", "layer", "norms", "norm", "replicate", None, lambda c: (_h(c),)),
    Role("ffn_norm", "post_attention_layernorm.weight", "layer", "norms", "norm", "replicate", None,
         lambda c: (_h(c),)),
    Role("q_a", "self_attn.q_a_proj.weight", "attn_q_lora", "attention", "linear", "replicate", None,
         lambda c: (c.q_lora_rank or 0, _h(c))),
    Role("q_a_norm", "self_attn.q_a_layernorm.weight", "attn_q_lora", "norms", "norm", "replicate", None,
         lambda c: (c.q_lora_rank or 0,)),
    Role("q_b", "self_attn.q_b_proj.weight", "attn_q_lora", "attention", "linear", "column", None,
         lambda c: (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank or 0)),
    Role("q", "self_attn.q_proj.weight", "attn_q", "attention", "linear", "column", None,
         lambda c: (c.num_attention_heads * c.qk_head_dim, _h(c))),
    Role("kv_a", "self_attn.kv_a_proj_with_mqa.weight", "layer", "attention", "linear", "replicate", None,
         lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, _h(c))),
    Role("kv_a_norm", "self_attn.kv_a_layernorm.weight", "layer", "norms", "norm", "replicate", None,
         lambda c: (c.kv_lora_rank,)),
    Role("kv_b", "self_attn.kv_b_proj.weight", "layer", "attention", "linear", "column", None,
         lambda c: (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)),
    Role("o", "self_attn.o_proj.weight", "layer", "attention", "linear", "row", None,
         lambda c: (_h(c), c.num_attention_heads * c.v_head_dim)),
    # dense MLP layers
    Role("dense_gate", "mlp.gate_proj.weight", "dense", "dense_mlp", "linear", "column", None,
         lambda c: (c.intermediate_size, _h(c))),
    Role("dense_up", "mlp.up_proj.weight", "dense", "dense_mlp", "linear", "column", None,
         lambda c: (c.intermediate_size, _h(c))),
    Role("dense_down", "mlp.down_proj.weight", "dense", "dense_mlp", "linear", "row", None,
         lambda c: (_h(c), c.intermediate_size)),
    # MoE layers
    Role("router", "mlp.gate.weight", "moe", "router", "router", "replicate", None,
         lambda c: (c.n_routed_experts, _h(c))),
    Role("router_bias", "mlp.gate.e_score_correction_bias", "moe", "router", "bias", "replicate", None,
         lambda c: (c.n_routed_experts,)),
    Role("shared_gate", "mlp.shared_experts.gate_proj.weight", "moe", "shared_experts", "linear", "column",
         "shared", lambda c: (_shared_i(c), _h(c))),
    Role("shared_up", "mlp.shared_experts.up_proj.weight", "moe", "shared_experts", "linear", "column",
         "shared", lambda c: (_shared_i(c), _h(c))),
    Role("shared_down", "mlp.shared_experts.down_proj.weight", "moe", "shared_experts", "linear", "row",
         "shared", lambda c: (_h(c), _shared_i(c))),
    Role("expert_gate", "mlp.experts.{e}.gate_proj.weight", "moe", "routed_experts", "linear", "expert",
         "routed", lambda c: (c.moe_intermediate_size, _h(c))),
    Role("expert_up", "mlp.experts.{e}.up_proj.weight", "moe", "routed_experts", "linear", "expert",
         "routed", lambda c: (c.moe_intermediate_size, _h(c))),
    Role("expert_down", "mlp.experts.{e}.down_proj.weight", "moe", "routed_experts", "linear", "expert",
         "routed", lambda c: (_h(c), c.moe_intermediate_size)),
    # multi-token-prediction extras (DeepSeek README_WEIGHTS.md)
    Role("mtp_enorm", "enorm.weight", "mtp", "mtp", "norm", "replicate", None, lambda c: (_h(c),)),
    Role("mtp_hnorm", "hnorm.weight", "mtp", "mtp", "norm", "replicate", None, lambda c: (_h(c),)),
    Role("mtp_eh_proj", "eh_proj.weight", "mtp", "mtp", "linear", "replicate", None,
         lambda c: (_h(c), 2 * _h(c))),
    Role("mtp_embed", "embed_tokens.weight", "mtp", "mtp", "embedding", "vocab", None,
         lambda c: (c.vocab_size, _h(c))),
    Role("mtp_head_norm", "shared_head.norm.weight", "mtp", "mtp", "norm", "replicate", None,
         lambda c: (_h(c),)),
    Role("mtp_head", "shared_head.head.weight", "mtp", "mtp", "embedding", "vocab", None,
         lambda c: (c.vocab_size, _h(c))),
)  # fmt: skip


@dataclass(frozen=True)
class TensorRole:
    """A concrete tensor: its role, layer (None for global) and routed expert index."""

    role: Role
    layer: int | None
    expert: int | None
    shape: tuple[int, ...]
    mtp: bool = False  # belongs to a multi-token-prediction layer


def _layer_scopes(cfg: ModelConfig, layer: int) -> set[str]:
    scopes = {"layer", "attn_q_lora" if cfg.q_lora_rank else "attn_q"}
    scopes.add("moe" if cfg.is_moe_layer(layer) else "dense")
    if layer in cfg.mtp_layer_ids:
        scopes.add("mtp")
    return scopes


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorRole]:
    """Every tensor name a checkpoint of ``cfg`` must hold (scales excluded), in model order."""
    out: dict[str, TensorRole] = {}
    for role in ROLES:
        if role.scope == "global" and role.name != "lm_head":
            out[role.pattern] = TensorRole(role, None, None, role.shape(cfg))
    for layer in range(cfg.total_layers):
        scopes = _layer_scopes(cfg, layer)
        mtp = layer in cfg.mtp_layer_ids
        for role in ROLES:
            if role.scope not in scopes:
                continue
            experts = range(cfg.n_routed_experts) if role.expert == "routed" else [None]
            for e in experts:
                rest = role.pattern.format(e=e)
                out[f"model.layers.{layer}.{rest}"] = TensorRole(
                    role, layer, e, role.shape(cfg), mtp
                )
    for role in ROLES:
        if role.name in {"final_norm", "lm_head"} and role.pattern not in out:
            out[role.pattern] = TensorRole(role, None, None, role.shape(cfg))
    return out
