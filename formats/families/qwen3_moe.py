"""The Qwen3-MoE family (Qwen3-235B-A22B, Qwen3-30B-A3B and their -FP8 repos): config, tensor
role table, AWQ mappings.

Facts (read from transformers 5.23 ``models/qwen3_moe/{configuration,modeling}_qwen3_moe.py``;
reference/model_families.md §2): GQA attention with ``num_key_value_heads`` KV heads of
``head_dim`` channels (not ``hidden_size / heads``: 235B has 64 × 128 = 8192 > 4096), a per-head
RMSNorm on q and k (``q_norm`` / ``k_norm`` [head_dim], before RoPE), no attention bias; no
shared expert, no MTP layer, no router bias. Decoder layer ``L`` is a MoE layer iff
``L ∉ mlp_only_layers`` and ``num_experts > 0`` and ``(L + 1) % decoder_sparse_step == 0``
(``Qwen3MoeDecoderLayer.__init__``); the other layers hold a dense MLP of ``intermediate_size``.
Every released config has all layers MoE. Routing: ``softmax`` over all experts, top-k,
renormalised iff ``norm_topk_prob`` (transformers' default False; released configs say true) —
a ``RouterSpec`` with one group, no bias and scaling 1. The -FP8 repos are DeepSeek's 128×128
block format (``quantization_config.weight_block_size``).

Experts per expert (the released checkpoints, and what transformers 5.24's ``save_pretrained``
writes: it reverts its in-memory fused tensors, ``conversion_mapping.py:1386-1398``), or fused
3-D ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] (transformers' module
layout; ``formats/fused_experts.py``, either orientation by shape). The model types ``qwen3``
(dense, out of scope) and ``qwen3_5_moe`` / ``qwen3_next`` (other architectures) are refused.

AWQ (AutoAWQ's ``Qwen3MoeAWQForCausalLM`` mappings, as data):

=================================  ======================================================
prev op                            balanced linears
=================================  ======================================================
input_layernorm                    q_proj + k_proj + v_proj
v_proj                             o_proj — only when ``num_key_value_heads ==
                                   num_attention_heads`` (``Balance.when``)
post_attention_layernorm           dense gate/up, or EVERY routed expert's gate/up; router
                                   (``mlp.gate``) columns × s
up_proj (dense, expert e)          down_proj of the same MLP
=================================  ======================================================

v → o under GQA: o_proj's input channel ``h·d + c`` reads v row ``(h // g)·d + c`` (g = heads per
KV head), so one v row feeds g o-columns; a fold needs one scale shared by those g columns, which
the per-channel search does not produce. AutoAWQ applies the mapping only when the v and o
shapes agree; so do we — Qwen3-235B / 30B (4 KV heads) skip it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import HetquantError
from ..fused_experts import FusedExperts
from ._common import DENSE_MLP, GLOBALS, LAYER_NORMS, ROUTED_EXPERTS, ROUTER
from .base import ModelConfig, ModelFamily, register_family
from .deepseek_v3 import RouterSpec
from .fields import ConfigFields, source_quantization
from .mappings import AwqMappings, Balance
from .roles import Role
from .shapes import F, shape

__all__ = ["AWQ", "FAMILY", "ROLES", "Qwen3MoeConfig"]

_REQUIRED = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")  # fmt: skip
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    """The fields of a Qwen3-MoE HF config that conversion, calibration and loading need."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense layers (mlp_only_layers / sparse step); 0 when none
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: frozenset[int]  # a set: is_moe_layer runs per layer
    weight_block_size: tuple[int, int] | None
    rms_norm_eps: float
    raw: dict[str, Any]
    num_mtp_layers: int = 0

    @classmethod
    def parse(cls, raw: dict[str, Any], origin: str = "config.json") -> Qwen3MoeConfig:
        f = ConfigFields(raw, origin)
        f.require(_REQUIRED, "is this a Qwen3-MoE config?")
        v = {k: f.integer(k) for k in _REQUIRED}
        heads, kv = v["num_attention_heads"], v["num_key_value_heads"]
        if heads % kv:
            raise HetquantError(
                f"{origin}: num_attention_heads {heads} must be a positive multiple of "
                f"num_key_value_heads {kv}"
            )
        if raw.get("num_experts") == 0:
            raise HetquantError(
                f"{origin}: num_experts is 0: a dense Qwen3 is out of scope (hetquant converts "
                "MoE models)"
            )
        moe_keys = [k for k in _MOE_KEYS if raw.get(k) is None]
        if moe_keys:
            raise HetquantError(
                f"{origin}: a qwen3_moe config lacks the MoE field(s) {', '.join(moe_keys)}; "
                "add them from the checkpoint's published config.json"
            )
        moe = {k: f.integer(k) for k in _MOE_KEYS}
        if moe["num_experts_per_tok"] > moe["num_experts"]:
            raise HetquantError(
                f"{origin}: num_experts_per_tok {moe['num_experts_per_tok']} not in "
                f"[1, num_experts {moe['num_experts']}]"
            )
        cfg = cls(
            **v, **moe, head_dim=f.integer("head_dim", v["hidden_size"] // heads),
            intermediate_size=f.integer("intermediate_size", 0, lo=0),
            norm_topk_prob=f.flag("norm_topk_prob", False),
            decoder_sparse_step=f.integer("decoder_sparse_step", 1),
            mlp_only_layers=frozenset(f.integers("mlp_only_layers", ())),
            weight_block_size=source_quantization(f), rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            raw=raw,
        )  # fmt: skip
        if cfg.intermediate_size <= 0 and (dense := cfg.first_dense_layers()):
            raise HetquantError(
                f"{origin}: layers {dense[:5]} are dense (mlp_only_layers / decoder_sparse_step) "
                "but intermediate_size is missing"
            )
        return cfg

    def first_dense_layers(self, n: int = 5) -> list[int]:
        """Up to ``n`` of the dense layers, found without walking every layer (a hostile config
        may claim billions): the ``mlp_only_layers``, and with a sparse step > 1 layer 0 on."""
        step = range(min(self.num_hidden_layers, self.decoder_sparse_step - 1, n))
        only = (x for x in self.mlp_only_layers if x < self.num_hidden_layers)
        return sorted({*only, *step})[:n]

    # generic facts ---------------------------------------------------------------------------
    @property
    def tp_head_counts(self) -> tuple[int, ...]:
        return (self.num_attention_heads, self.num_key_value_heads)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer < self.num_hidden_layers
            and layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_scopes(self, layer: int) -> frozenset[str]:
        return frozenset({"layer", "moe" if self.is_moe_layer(layer) else "dense"})

    @classmethod
    def without_mtp(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return dict(raw)  # Qwen3-MoE has no MTP layers

    # the forward's ----------------------------------------------------------------------------
    def router(self) -> RouterSpec:
        """softmax top-k over all experts, renormalised iff ``norm_topk_prob``, no bias."""
        spec = RouterSpec(self.num_experts, self.num_experts_per_tok, 1, 1, "softmax", False,
                          self.norm_topk_prob, 1.0)  # fmt: skip
        spec.validate()
        return spec


# -- the role table ----------------------------------------------------------------------------


H = F.hidden_size
Q = F.num_attention_heads * F.head_dim  # q_proj's rows
KV = F.num_key_value_heads * F.head_dim  # k_proj's and v_proj's
R = Role
ROLES: tuple[Role, ...] = (
    *GLOBALS,
    *LAYER_NORMS,
    # every layer: GQA attention with per-head q/k norms
    R("q", "self_attn.q_proj.weight", "layer", "attention", "linear", "column", None,
      shape(Q, H), fuse="qkv_proj"),
    R("k", "self_attn.k_proj.weight", "layer", "attention", "linear", "column", None,
      shape(KV, H), fuse="qkv_proj"),
    R("v", "self_attn.v_proj.weight", "layer", "attention", "linear", "column", None,
      shape(KV, H), fuse="qkv_proj"),
    R("q_norm", "self_attn.q_norm.weight", "layer", "norms", "norm", "replicate", None,
      shape(F.head_dim)),
    R("k_norm", "self_attn.k_norm.weight", "layer", "norms", "norm", "replicate", None,
      shape(F.head_dim)),
    R("o", "self_attn.o_proj.weight", "layer", "attention", "linear", "row", None,
      shape(H, Q)),
    *DENSE_MLP,  # the mlp_only_layers / decoder_sparse_step layers
    ROUTER,  # MoE layers: router and routed experts, no shared expert, no router bias
    *ROUTED_EXPERTS,
)  # fmt: skip


# -- AWQ ---------------------------------------------------------------------------------------


def _no_gqa(c: Qwen3MoeConfig) -> bool:
    """v → o folds only when v_proj and o_proj's input have the same channels (no GQA)."""
    return c.num_key_value_heads == c.num_attention_heads


AWQ = AwqMappings(
    balances=(
        Balance("attn_in", "attn_norm", ("q", "k", "v")),
        Balance("o", "v", ("o",), when=_no_gqa),
    ),
    clips=("q", "k", "v", "o"),
    mlp_input=Balance(
        "mlp_in",
        "ffn_norm",
        ("dense_gate", "dense_up", "expert_gate", "expert_up"),
        compensate="router",
    ),
    clip_skip=("q_proj", "k_proj"),
)

FAMILY = register_family(
    ModelFamily(
        "qwen3_moe",
        Qwen3MoeConfig,
        ROLES,
        AWQ,
        model_types=("qwen3_moe",),
        architectures=("Qwen3MoeForCausalLM",),
        refused_types=(
            ("qwen3", "a dense Qwen3 (no experts) is out of scope: hetquant converts MoE models "
                      "(Qwen3-MoE: model_type qwen3_moe)"),
            ("qwen3_5_moe", "Qwen3.5-MoE (shared expert, linear attention) is not supported"),
            ("qwen3_next", "Qwen3-Next (shared expert, Gated DeltaNet attention) is not supported"),
        ),
        fused_experts=FusedExperts(transposed=False),
    )
)  # fmt: skip
