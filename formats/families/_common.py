"""Role-table rows that MoE families share verbatim (names, groups, splits and shapes from the
generic ``ModelConfig`` attributes plus ``intermediate_size`` / ``moe_intermediate_size``): the
embedding, final norm and head, the two pre-norms, a dense gated MLP (scope ``dense``), the
router and the per-expert routed MLP (scope ``moe``). A family splices them into its table at
the positions it wants: table order is model order (manifests record it)."""

from __future__ import annotations

from .roles import GLOBAL, GLOBAL_LAST, Role
from .shapes import F, shape

__all__ = ["DENSE_MLP", "GLOBALS", "LAYER_NORMS", "ROUTED_EXPERTS", "ROUTER"]

H, V = F.hidden_size, F.vocab_size

R = Role
GLOBALS = (  # the embedding and final norm before the layers, lm_head after them
    R("embed", "model.embed_tokens.weight", GLOBAL, "embeddings", "embedding", "vocab", None,
      shape(V, H)),
    R("final_norm", "model.norm.weight", GLOBAL, "norms", "norm", "replicate", None, shape(H)),
    R("lm_head", "lm_head.weight", GLOBAL_LAST, "embeddings", "head", "vocab", None,
      shape(V, H)),
)  # fmt: skip
LAYER_NORMS = (
    R("attn_norm", "input_layernorm.weight", "layer", "norms", "norm", "replicate", None, shape(H)),
    R("ffn_norm", "post_attention_layernorm.weight", "layer", "norms", "norm", "replicate", None,
      shape(H)),
)  # fmt: skip
DENSE_MLP = (
    R("dense_gate", "mlp.gate_proj.weight", "dense", "dense_mlp", "linear", "column", None,
      shape(F.intermediate_size, H), mlp="gate"),
    R("dense_up", "mlp.up_proj.weight", "dense", "dense_mlp", "linear", "column", None,
      shape(F.intermediate_size, H), mlp="up"),
    R("dense_down", "mlp.down_proj.weight", "dense", "dense_mlp", "linear", "row", None,
      shape(H, F.intermediate_size), mlp="down"),
)  # fmt: skip
ROUTER = R("router", "mlp.gate.weight", "moe", "router", "router", "replicate", None,
           shape(F.num_experts, H))  # fmt: skip
ROUTED_EXPERTS = (
    R("expert_gate", "mlp.experts.{e}.gate_proj.weight", "moe", "routed_experts", "linear", "column",
      "routed", shape(F.moe_intermediate_size, H), mlp="gate"),
    R("expert_up", "mlp.experts.{e}.up_proj.weight", "moe", "routed_experts", "linear", "column",
      "routed", shape(F.moe_intermediate_size, H), mlp="up"),
    R("expert_down", "mlp.experts.{e}.down_proj.weight", "moe", "routed_experts", "linear", "row",
      "routed", shape(H, F.moe_intermediate_size), mlp="down"),
)  # fmt: skip
