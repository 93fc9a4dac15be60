"""The DeepSeek-V3 family (DeepSeek-V3, R1; Kimi K2 through its DeepseekV3ForCausalLM
architecture): config, tensor role table, AWQ mappings.

Role table: every tensor of a checkpoint is a row — its name pattern (relative to
``model.layers.{L}.`` for layer tensors), role, precision group, kind, tensor-parallel split
(``column``: dim 0 of [out, in]; ``row``: dim 1; ``replicate``; ``vocab``: dim 0 of an embedding
or head, padded), expert kind and expected shape as a function of the config. Layer ids, the MTP
layer and the dense/MoE split come from config.json, never from literals. Scales of FP8 weights
(``<weight>_scale_inv``) are partners, not rows. Scopes: ``layer`` (every decoder layer),
``attn_q_lora`` / ``attn_q`` (``q_lora_rank`` set or not), ``dense`` / ``moe``, ``moe_shared``
(MoE layers with shared experts), ``mtp`` (the MTP layers' extras, DeepSeek README_WEIGHTS.md).

AWQ (``mappings.py`` says how they run; AutoAWQ's DeepSeek-V3 mappings, plus ours):

=================================  ======================================================
prev op                            balanced linears
=================================  ======================================================
input_layernorm                    q_a_proj (or q_proj) + kv_a_proj_with_mqa
q_a_layernorm                      q_b_proj
kv_a_layernorm                     kv_b_proj
kv_b_proj, v rows of every head    o_proj (``fold_o_proj``, off by default)
post_attention_layernorm           dense gate/up, or shared gate/up + EVERY routed expert's
                                   gate/up; router (``mlp.gate``) columns × s
up_proj (dense, shared, expert e)  down_proj of the same MLP
=================================  ======================================================

o_proj: MLA has no v_proj, but ``v = kv_b_proj_v · latent`` per head and the attention output is
linear in v, so o_proj's input channel ``h·dv + d`` divided by s is exactly kv_b_proj's row
``h·(dn + dv) + dn + d`` divided by s (``_v_rows``). ``calib/layer.py`` documents the router
compensation and the expert decisions.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from .._lazy import torch
from ..errors import HetquantError
from ._common import DENSE_MLP, GLOBALS, LAYER_NORMS, ROUTED_EXPERTS, ROUTER
from .base import ModelConfig, ModelFamily, register_family
from .fields import REQUIRED, ConfigFields, source_quantization
from .mappings import AwqMappings, Balance
from .roles import MTP, Role
from .shapes import F, shape

__all__ = ["AWQ", "FAMILY", "ROLES", "DeepseekV3Config", "RouterSpec"]


# config.json fields read with a default (the rest are required integers >= 1, or >= 0 here)
_OPTIONAL = frozenset({"q_lora_rank", "weight_block_size", "raw", "num_nextn_predict_layers",
                       "moe_layer_freq", "rms_norm_eps"})  # fmt: skip
_MAY_BE_ZERO = frozenset({"n_routed_experts", "n_shared_experts", "first_k_dense_replace"})


@dataclass(frozen=True)
class DeepseekV3Config(ModelConfig):
    """The fields of a DeepSeek-V3 HF config that conversion, calibration and loading need."""

    # model
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    # mla
    num_attention_heads: int
    q_lora_rank: int | None  # None: q_proj instead of q_a/q_b (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # mlp / moe
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    # source quantization (DeepSeek's FP8 block size; None when the source is not FP8)
    weight_block_size: tuple[int, int] | None
    rms_norm_eps: float
    raw: dict[str, Any]

    @classmethod
    def parse(cls, raw: dict[str, Any], origin: str = "config.json") -> DeepseekV3Config:
        f = ConfigFields(raw, origin)
        # a subclass's fields too (V3.2's indexer), but not those with a default (a VLM's)
        names = [x.name for x in fields(cls) if x.name not in _OPTIONAL
                 and x.default is MISSING and x.default_factory is MISSING]  # fmt: skip
        f.require(names, "is this a DeepSeek-V3-family config?")
        values = {n: f.integer(n, lo=0 if n in _MAY_BE_ZERO else 1) for n in names}
        _router_fields(f, None)
        return cls(
            raw=raw,
            q_lora_rank=f.integer("q_lora_rank", None),
            num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 0, lo=0),
            moe_layer_freq=f.integer("moe_layer_freq", 1),
            weight_block_size=source_quantization(f),
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            **values,
        )

    # generic facts ---------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def layer_scopes(self, layer: int) -> frozenset[str]:
        scopes = {"layer", "attn_q_lora" if self.q_lora_rank else "attn_q"}
        if not self.is_moe_layer(layer):
            scopes.add("dense")
        else:
            scopes |= {"moe", "moe_shared"} if self.n_shared_experts else {"moe"}
        return frozenset(scopes)

    @classmethod
    def without_mtp(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "num_nextn_predict_layers": 0}

    # the forward's ----------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def router(self) -> RouterSpec:
        """The routing fields (read when a forward needs them: convert does not)."""
        return RouterSpec.from_config(self.decoder_raw, self.n_routed_experts)


# DeepSeek's routing methods (modeling_deepseek.py MoEGate: V2's greedy ones, V3's noaux_tc)
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RouterSpec:
    """The routing fields of a DeepSeek config (``runtime/forward/moe.py`` ``route`` documents them)."""

    n_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    n_group: int
    topk_group: int
    scoring: str  # "sigmoid" | "softmax"
    use_bias: bool  # topk_method == "noaux_tc": e_score_correction_bias steers the choice
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor

    @classmethod
    def from_config(
        cls, raw: dict[str, Any], n_experts: int, origin: str = "config.json"
    ) -> RouterSpec:
        need = ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "topk_method")
        missing = [k for k in need if raw.get(k) is None]
        if missing:
            raise HetquantError(f"{origin}: MoE model lacks {', '.join(missing)}")
        spec = cls(n_experts=n_experts, **_router_fields(ConfigFields(raw, origin), REQUIRED))
        spec.validate()
        return spec

    def validate(self) -> None:
        e, g = self.n_experts, self.n_group
        if self.scoring not in ("sigmoid", "softmax"):
            raise HetquantError(f"config.json: scoring_func {self.scoring!r} is not supported")
        if g < 1 or e % g:
            raise HetquantError(
                f"config.json: n_routed_experts {e} is not divisible by n_group {g}"
            )
        if not 1 <= self.topk_group <= g:
            raise HetquantError(f"config.json: topk_group {self.topk_group} not in [1, {g}]")
        if not 1 <= self.top_k <= self.topk_group * (e // g):
            raise HetquantError(
                f"config.json: num_experts_per_tok {self.top_k} exceeds the "
                f"{self.topk_group * (e // g)} experts of the kept groups"
            )
        if g > 1 and self.use_bias and e // g < 2:
            raise HetquantError("config.json: noaux_tc group scoring needs >= 2 experts per group")


def _router_fields(f: ConfigFields, default: Any) -> dict[str, Any]:
    """The routing fields of ``RouterSpec`` but ``n_experts``, type-checked; ``default``: what an
    absent field reads as (``REQUIRED`` for a forward; None for ``parse``, which checks the types
    of those present: convert does not route, but the artifact carries them to every forward)."""
    return dict(
        top_k=f.integer("num_experts_per_tok", default),
        n_group=f.integer("n_group", default),
        topk_group=f.integer("topk_group", default),
        scoring=f.text("scoring_func", "sigmoid", ("sigmoid", "softmax")),
        use_bias=f.text("topk_method", default, TOPK_METHODS) == "noaux_tc",
        norm_topk_prob=f.flag("norm_topk_prob", default),
        scaling=f.number("routed_scaling_factor", 1.0, positive=True),
    )


# -- the role table ----------------------------------------------------------------------------


H, HEADS, Q_RANK = F.hidden_size, F.num_attention_heads, F.q_lora_rank.or_zero
SHARED_I = F.moe_intermediate_size * F.n_shared_experts  # the shared experts as one MLP
R = Role
ROLES: tuple[Role, ...] = (
    *GLOBALS,
    *LAYER_NORMS,
    R("q_a", "self_attn.q_a_proj.weight", "attn_q_lora", "attention", "linear", "replicate", None,
      shape(Q_RANK, H), fuse="fused_qkv_a_proj"),
    R("q_a_norm", "self_attn.q_a_layernorm.weight", "attn_q_lora", "norms", "norm", "replicate", None,
      shape(Q_RANK)),
    R("q_b", "self_attn.q_b_proj.weight", "attn_q_lora", "attention", "linear", "column", None,
      shape(HEADS * F.qk_head_dim, Q_RANK)),
    R("q", "self_attn.q_proj.weight", "attn_q", "attention", "linear", "column", None,
      shape(HEADS * F.qk_head_dim, H)),
    R("kv_a", "self_attn.kv_a_proj_with_mqa.weight", "layer", "attention", "linear", "replicate", None,
      shape(F.kv_lora_rank + F.qk_rope_head_dim, H), fuse="fused_qkv_a_proj"),
    R("kv_a_norm", "self_attn.kv_a_layernorm.weight", "layer", "norms", "norm", "replicate", None,
      shape(F.kv_lora_rank)),
    R("kv_b", "self_attn.kv_b_proj.weight", "layer", "attention", "linear", "column", None,
      shape(HEADS * (F.qk_nope_head_dim + F.v_head_dim), F.kv_lora_rank),
      absorbed=True),
    R("o", "self_attn.o_proj.weight", "layer", "attention", "linear", "row", None,
      shape(H, HEADS * F.v_head_dim)),
    *DENSE_MLP,
    ROUTER,
    R("router_bias", "mlp.gate.e_score_correction_bias", "moe", "router", "bias", "replicate", None,
      shape(F.n_routed_experts)),
    R("shared_gate", "mlp.shared_experts.gate_proj.weight", "moe_shared", "shared_experts", "linear",
      "column", "shared", shape(SHARED_I, H), mlp="gate"),
    R("shared_up", "mlp.shared_experts.up_proj.weight", "moe_shared", "shared_experts", "linear",
      "column", "shared", shape(SHARED_I, H), mlp="up"),
    R("shared_down", "mlp.shared_experts.down_proj.weight", "moe_shared", "shared_experts", "linear",
      "row", "shared", shape(H, SHARED_I), mlp="down"),
    *ROUTED_EXPERTS,
    # multi-token-prediction extras
    R("mtp_enorm", "enorm.weight", MTP, "mtp", "norm", "replicate", None, shape(H)),
    R("mtp_hnorm", "hnorm.weight", MTP, "mtp", "norm", "replicate", None, shape(H)),
    R("mtp_eh_proj", "eh_proj.weight", MTP, "mtp", "linear", "replicate", None,
      shape(H, 2 * H)),
    R("mtp_embed", "embed_tokens.weight", MTP, "mtp", "embedding", "vocab", None,
      shape(F.vocab_size, H)),
    R("mtp_head_norm", "shared_head.norm.weight", MTP, "mtp", "norm", "replicate", None,
      shape(H)),
    R("mtp_head", "shared_head.head.weight", MTP, "mtp", "head", "vocab", None,
      shape(F.vocab_size, H)),
)  # fmt: skip


# -- AWQ ---------------------------------------------------------------------------------------


def _v_rows(c: DeepseekV3Config) -> torch.Tensor:
    """kv_b_proj's v rows in o_proj input order: head h, channel d → h·(dn+dv) + dn + d."""
    dn, dv = c.qk_nope_head_dim, c.v_head_dim
    heads = torch.arange(c.num_attention_heads)[:, None] * (dn + dv)  # [H, 1]
    return (heads + dn + torch.arange(dv)[None, :]).reshape(-1)  # [H·dv]


AWQ = AwqMappings(
    balances=(
        Balance("attn_in", "attn_norm", ("q_a", "q", "kv_a")),
        Balance("q_b", "q_a_norm", ("q_b",)),
        Balance("kv_b", "kv_a_norm", ("kv_b",)),
        Balance("o", "kv_b", ("o",), rows=_v_rows, option="fold_o_proj"),
    ),
    clips=("q_a", "q", "kv_a", "kv_b", "o", "q_b"),
    mlp_input=Balance(
        "mlp_in",
        "ffn_norm",
        ("dense_gate", "dense_up", "shared_gate", "shared_up", "expert_gate", "expert_up"),
        compensate="router",
    ),
    clip_skip=("q_a_proj", "q_b_proj", "q_proj"),
)

FAMILY = register_family(
    ModelFamily(
        "deepseek_v3",
        DeepseekV3Config,
        ROLES,
        AWQ,
        model_types=("deepseek_v3",),
        architectures=("DeepseekV3ForCausalLM",),
    )
)
