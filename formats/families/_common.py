"""Role-table rows that MoE families share verbatim (names, groups, splits and shapes from the
generic ``ModelConfig`` attributes plus ``intermediate_size`` / ``moe_intermediate_size``): the
embedding, final norm and head, the two pre-norms, a dense gated MLP (scope ``dense``), the
router and the per-expert routed MLP (scope ``moe``). A family splices them into its table at
the positions it wants: table order is model order (manifests record it)."""

from __future__ import annotations

from typing import Any

from .roles import GLOBAL, GLOBAL_LAST, Role

__all__ = ["DENSE_MLP", "GLOBALS", "LAYER_NORMS", "ROUTED_EXPERTS", "ROUTER"]


def _h(c: Any) -> int:
    return c.hidden_size


R = Role
GLOBALS = (  # the embedding and final norm before the layers, lm_head after them
    R("embed", "model.embed_tokens.weight", GLOBAL, "embeddings", "embedding", "vocab", None,
      lambda c: (c.vocab_size, _h(c))),
    R("final_norm", "model.norm.weight", GLOBAL, "norms", "norm", "replicate", None, lambda c: (_h(c),)),
    R("lm_head", "lm_head.weight", GLOBAL_LAST, "embeddings", "head", "vocab", None,
      lambda c: (c.vocab_size, _h(c))),
)  # fmt: skip
LAYER_NORMS = (
    R("attn_norm", "input_layernorm.weight", "layer", "norms", "norm", "replicate", None, lambda c: (_h(c),)),
    R("ffn_norm", "post_attention_layernorm.weight", "layer", "norms", "norm", "replicate", None,
      lambda c: (_h(c),)),
)  # fmt: skip
DENSE_MLP = (
    R("dense_gate", "mlp.gate_proj.weight", "dense", "dense_mlp", "linear", "column", None,
      lambda c: (c.intermediate_size, _h(c)), mlp="gate"),
    R("dense_up", "mlp.up_proj.weight", "dense", "dense_mlp", "linear", "column", None,
      lambda c: (c.intermediate_size, _h(c)), mlp="up"),
    R("dense_down", "mlp.down_proj.weight", "dense", "dense_mlp", "linear", "row", None,
      lambda c: (_h(c), c.intermediate_size), mlp="down"),
)  # fmt: skip
ROUTER = R("router", "mlp.gate.weight", "moe", "router", "router", "replicate", None,
           lambda c: (c.num_experts, _h(c)))  # fmt: skip
ROUTED_EXPERTS = (
    R("expert_gate", "mlp.experts.{e}.gate_proj.weight", "moe", "routed_experts", "linear", "column",
      "routed", lambda c: (c.moe_intermediate_size, _h(c)), mlp="gate"),
    R("expert_up", "mlp.experts.{e}.up_proj.weight", "moe", "routed_experts", "linear", "column",
      "routed", lambda c: (c.moe_intermediate_size, _h(c)), mlp="up"),
    R("expert_down", "mlp.experts.{e}.down_proj.weight", "moe", "routed_experts", "linear", "row",
      "routed", lambda c: (_h(c), c.moe_intermediate_size), mlp="down"),
)  # fmt: skip
