"""The DeepSeek-V3.2 family (``model_type: deepseek_v32``, ``DeepseekV32ForCausalLM``): DeepSeek-V3
plus the DSA lightning indexer in every layer's attention.

Config: V3's fields plus ``index_n_heads`` (64), ``index_head_dim`` (128) and ``index_topk``
(2048); FP8 block source with ``scale_fmt: ue8m0`` (``reference/model_families.md`` §4).

The indexer's tensors, under ``model.layers.L.self_attn.indexer.`` (DeepSeek-V3.2-Exp
``inference/model.py`` ``Indexer``: ``wq_b = Linear(q_lora_rank, n_heads·head_dim)`` and
``wk = Linear(dim, head_dim)`` default FP8 linears, ``k_norm = LayerNorm(head_dim)`` with a bias,
``weights_proj = Linear(dim, n_heads, dtype=default)`` BF16):

=========================  ===============================  ========================
tensor                     shape                            source dtype
=========================  ===============================  ========================
``wq_b.weight``            [index_n_heads·index_head_dim,   FP8 + ``weight_scale_inv``
                           q_lora_rank]
``wk.weight``              [index_head_dim, hidden]         FP8 + ``weight_scale_inv``
``k_norm.weight``, ``.bias``  [index_head_dim]              BF16 / F32 (not verified)
``weights_proj.weight``    [index_n_heads, hidden]          BF16
=========================  ===============================  ========================

Every recipe keeps them at source precision (``kept`` roles: FP8 dequantized exactly to BF16,
the rest copied; ``FLOAT`` in Ascend descriptions): engines read the indexer unquantized, and
what vllm-ascend's ``indexer_quant_type`` variants expect was not verified. They are replicated
under tensor parallelism. The reference data sheet leaves open whether the MTP layer carries an
indexer; the reference code builds the MTP block from the same ``Block`` (attention with its
indexer), so the table expects one in every layer, MTP included.

``hetquant run`` / ``eval`` refuse the family (``forward_refusal``): the reference forward does
not implement the indexer's top-k sparse attention, and dense attention in its place would be a
different model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ModelFamily, register_family
from .deepseek_v3 import AWQ, ROLES, DeepseekV3Config
from .roles import Role
from .shapes import F, shape

__all__ = ["FAMILY", "INDEXER_ROLES", "DeepseekV32Config"]


@dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    """DeepSeek-V3's config plus the indexer's (all required; parsed as V3's integer fields)."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int


R = Role
INDEXER_ROLES: tuple[Role, ...] = (
    R("indexer_wq_b", "self_attn.indexer.wq_b.weight", "attn_q_lora", "indexer", "linear",
      "replicate", None, shape(F.index_n_heads * F.index_head_dim, F.q_lora_rank.or_zero), kept=True),
    R("indexer_wk", "self_attn.indexer.wk.weight", "layer", "indexer", "linear", "replicate", None,
      shape(F.index_head_dim, F.hidden_size), kept=True),
    R("indexer_k_norm", "self_attn.indexer.k_norm.weight", "layer", "indexer", "norm", "replicate",
      None, shape(F.index_head_dim), kept=True),
    R("indexer_k_norm_bias", "self_attn.indexer.k_norm.bias", "layer", "indexer", "bias",
      "replicate", None, shape(F.index_head_dim), kept=True),
    R("indexer_weights_proj", "self_attn.indexer.weights_proj.weight", "layer", "indexer", "linear",
      "replicate", None, shape(F.index_n_heads, F.hidden_size), kept=True),
)  # fmt: skip

_AT = next(i for i, r in enumerate(ROLES) if r.name == "o") + 1  # after the attention rows

FAMILY = register_family(
    ModelFamily(
        "deepseek_v32",
        DeepseekV32Config,
        ROLES[:_AT] + INDEXER_ROLES + ROLES[_AT:],
        AWQ,
        model_types=("deepseek_v32",),
        architectures=("DeepseekV32ForCausalLM",),
        forward_refusal=(
            "DeepSeek-V3.2's lightning indexer (top-k sparse attention) is not implemented in "
            "hetquant's reference forward, so run and eval refuse it rather than run dense "
            "attention; convert, inspect and verify work"
        ),
    )
)
