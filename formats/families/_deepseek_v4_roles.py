"""DeepSeek-V4's role tables, over DeepSeek's own tensor names (``deepseek_v4.py`` says when each
layout applies).

Names and shapes were read from transformers 5.24: ``DeepseekV4ForCausalLM(config).save_pretrained``
writes DeepSeek's module names back (the inverse of ``conversion_mapping.py`` "deepseek_v4",
lines 711-760) under ``model.``; the modules are ``modeling_deepseek_v4.py`` ``DeepseekV4Attention``
(782-792), the compressors (384-387 HCA, 612-617 CSA), ``DeepseekV4Indexer`` (495-501),
``DeepseekV4HyperConnection`` (930-937), ``DeepseekV4HyperHead`` (992-996), the routers (1064-1122).
DeepSeek's own checkpoint differs from that output in three places, read from vLLM 0.32's loader
of it: the attention's KV norm is ``attn.kv_norm`` (``vllm/models/deepseek_v4/attention.py:266``;
transformers' inverse mapping turns its ``kv_norm`` into ``norm``), globals carry no ``model.``
(``embed.weight``, ``norm.weight``, ``hc_head_fn``: ``cpu/model.py:826-840``), and the MTP layer
is ``mtp.0.`` with ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``, ``hc_head_*``
beside a sliding-attention, top-k MoE block (``nvidia/mtp.py:102-143``, ``366-370``). Whether
DeepSeek's MTP layer also stores ``emb.tok_emb`` / ``head`` (vLLM renames them if present) was not
verified; the table expects neither (they would be refused by name as matching no role).

Scopes: ``layer`` (every layer), ``swa`` / ``csa`` / ``hca`` (the attention type), ``hash`` /
``topk`` (the router), ``shared`` (with shared experts), ``mtp``. Precision: the attention
linears and shared experts are block FP8 in the source, routed experts FP4 (or FP8), the
compressors, the indexer, hyper-connections, sinks and the hash table are ``kept`` (every recipe
keeps them at source precision: engines read them unquantized — vLLM builds the compressor's and
the indexer's ``weights_proj`` with ``quant_config=None``, ``compressor.py:271-276``,
``attention.py:982-987``), as are the MTP layer's extras.
"""

from __future__ import annotations

import dataclasses

from .roles import GLOBAL, GLOBAL_LAST, MTP, Role
from .shapes import Call, F, Field, shape

__all__ = ["HF_GLOBALS", "LAYER_ROLES", "MTP_ROLES", "NATIVE_GLOBALS", "hf_roles"]


H, HC, HEADS = F.hidden_size, F.hc_mult, F.num_attention_heads
SHARED_I = F.moe_intermediate_size * F.n_shared_experts  # the shared experts as one MLP


def _hc(scope: str, prefix: str) -> tuple[Role, ...]:
    """A hyper-connection's ``fn`` [(2+n)·n, n·H], ``base`` [(2+n)·n], ``scale`` [3]."""
    return (
        R(f"hc_{prefix}_fn", f"hc_{prefix}_fn", scope, "hyper_connections", "norm", "replicate",
          None, shape(F.streams, HC * H), kept=True),
        R(f"hc_{prefix}_base", f"hc_{prefix}_base", scope, "hyper_connections", "norm",
          "replicate", None, shape(F.streams), kept=True),
        R(f"hc_{prefix}_scale", f"hc_{prefix}_scale", scope, "hyper_connections", "norm",
          "replicate", None, shape(3), kept=True),
    )  # fmt: skip


def _head_hc(scope: str, names: tuple[str, str, str]) -> tuple[Role, ...]:
    """The hyper-head's ``fn`` [n, n·H], ``base`` [n], ``scale`` [1] (role names ``hc_head_*``,
    or ``mtp_hc_head_*`` in the MTP layer)."""
    tag = "mtp_" if scope == MTP else ""
    fn, base, scale = names
    return (
        R(f"{tag}hc_head_fn", fn, scope, "hyper_connections", "norm", "replicate", None,
          shape(HC, HC * H), kept=True),
        R(f"{tag}hc_head_base", base, scope, "hyper_connections", "norm", "replicate", None,
          shape(HC), kept=True),
        R(f"{tag}hc_head_scale", scale, scope, "hyper_connections", "norm", "replicate", None,
          shape(1), kept=True),
    )  # fmt: skip


def _compressor(scope: str, where: str, coff: int, dim: str) -> tuple[Role, ...]:
    """A compressor (``coff`` 2: overlapping windows, CSA and the indexer's; 1: HCA) of ``dim``
    (the head dim it compresses to) at rate ``c.rate(scope)``."""
    tag, d, rate = where.replace(".", "_"), Field(dim), Call("rate", scope)
    return (
        R(f"{tag}_ape_{scope}", f"{where}.ape", scope, "compressor", "bias", "replicate", None,
          shape(rate, coff * d), kept=True),
        R(f"{tag}_wkv_{scope}", f"{where}.wkv.weight", scope, "compressor", "linear", "replicate",
          None, shape(coff * d, H), kept=True),
        R(f"{tag}_wgate_{scope}", f"{where}.wgate.weight", scope, "compressor", "linear",
          "replicate", None, shape(coff * d, H), kept=True),
        R(f"{tag}_norm_{scope}", f"{where}.norm.weight", scope, "compressor", "norm", "replicate",
          None, shape(d), kept=True),
    )  # fmt: skip


R = Role
NATIVE_GLOBALS: tuple[Role, ...] = (
    R("embed", "embed.weight", GLOBAL, "embeddings", "embedding", "vocab", None,
      shape(F.vocab_size, H)),
    R("final_norm", "norm.weight", GLOBAL_LAST, "norms", "norm", "replicate", None,
      shape(H)),
    *_head_hc(GLOBAL_LAST, ("hc_head_fn", "hc_head_base", "hc_head_scale")),
    R("lm_head", "head.weight", GLOBAL_LAST, "embeddings", "head", "vocab", None,
      shape(F.vocab_size, H)),
)  # fmt: skip
HF_GLOBALS: tuple[Role, ...] = (
    R("embed", "model.embed_tokens.weight", GLOBAL, "embeddings", "embedding", "vocab", None,
      shape(F.vocab_size, H)),
    R("final_norm", "model.norm.weight", GLOBAL_LAST, "norms", "norm", "replicate", None,
      shape(H)),
    *_head_hc(GLOBAL_LAST, ("model.hc_head.hc_fn", "model.hc_head.hc_base",
                            "model.hc_head.hc_scale")),
    R("lm_head", "head.weight", GLOBAL_LAST, "embeddings", "head", "vocab", None,
      shape(F.vocab_size, H)),
)  # fmt: skip

LAYER_ROLES: tuple[Role, ...] = (
    *_hc("layer", "attn"),
    R("attn_norm", "attn_norm.weight", "layer", "norms", "norm", "replicate", None,
      shape(H)),
    R("q_a", "attn.wq_a.weight", "layer", "attention", "linear", "replicate", None,
      shape(F.q_lora_rank, H), fuse="fused_wqa_wkv"),
    R("q_a_norm", "attn.q_norm.weight", "layer", "norms", "norm", "replicate", None,
      shape(F.q_lora_rank)),
    R("q_b", "attn.wq_b.weight", "layer", "attention", "linear", "column", None,
      shape(HEADS * F.head_dim, F.q_lora_rank)),
    R("kv", "attn.wkv.weight", "layer", "attention", "linear", "replicate", None,
      shape(F.head_dim, H), fuse="fused_wqa_wkv"),
    R("kv_norm", "attn.kv_norm.weight", "layer", "norms", "norm", "replicate", None,
      shape(F.head_dim)),
    # one sink per head, split with the heads (as q_b's rows): a TP rank keeps its heads' sinks
    R("sinks", "attn.attn_sink", "layer", "attention", "bias", "column", None,
      shape(HEADS), kept=True),
    *_compressor("csa", "attn.compressor", 2, "head_dim"),
    *_compressor("csa", "attn.indexer.compressor", 2, "index_head_dim"),
    R("indexer_wq_b", "attn.indexer.wq_b.weight", "csa", "indexer", "linear", "replicate", None,
      shape(F.index_n_heads * F.index_head_dim, F.q_lora_rank), kept=True),
    R("indexer_weights_proj", "attn.indexer.weights_proj.weight", "csa", "indexer", "linear",
      "replicate", None, shape(F.index_n_heads, H), kept=True),
    *_compressor("hca", "attn.compressor", 1, "head_dim"),
    # grouped output projection: o_groups blocks of [o_lora, heads·head_dim / o_groups], then mix
    R("o_a", "attn.wo_a.weight", "layer", "attention", "linear", "column", None,
      shape(F.o_groups * F.o_lora_rank, HEADS * F.head_dim // F.o_groups)),
    R("o_b", "attn.wo_b.weight", "layer", "attention", "linear", "row", None,
      shape(H, F.o_groups * F.o_lora_rank)),
    *_hc("layer", "ffn"),
    R("ffn_norm", "ffn_norm.weight", "layer", "norms", "norm", "replicate", None,
      shape(H)),
    R("router", "ffn.gate.weight", "layer", "router", "router", "replicate", None,
      shape(F.n_routed_experts, H)),
    R("router_bias", "ffn.gate.bias", "topk", "router", "bias", "replicate", None,
      shape(F.n_routed_experts)),
    R("hash_table", "ffn.gate.tid2eid", "hash", "router", "index", "replicate", None,
      shape(F.vocab_size, F.num_experts_per_tok), kept=True),
    R("shared_gate", "ffn.shared_experts.w1.weight", "shared", "shared_experts", "linear",
      "column", "shared", shape(SHARED_I, H), mlp="gate"),
    R("shared_up", "ffn.shared_experts.w3.weight", "shared", "shared_experts", "linear",
      "column", "shared", shape(SHARED_I, H), mlp="up"),
    R("shared_down", "ffn.shared_experts.w2.weight", "shared", "shared_experts", "linear", "row",
      "shared", shape(H, SHARED_I), mlp="down"),
    R("expert_gate", "ffn.experts.{e}.w1.weight", "layer", "routed_experts", "linear", "column",
      "routed", shape(F.moe_intermediate_size, H), mlp="gate"),
    R("expert_up", "ffn.experts.{e}.w3.weight", "layer", "routed_experts", "linear", "column",
      "routed", shape(F.moe_intermediate_size, H), mlp="up"),
    R("expert_down", "ffn.experts.{e}.w2.weight", "layer", "routed_experts", "linear", "row",
      "routed", shape(H, F.moe_intermediate_size), mlp="down"),
)  # fmt: skip

MTP_ROLES: tuple[Role, ...] = (  # DeepSeek-V4's MTP layer extras, under ``mtp.{m}.``
    R("mtp_enorm", "enorm.weight", MTP, "mtp", "norm", "replicate", None, shape(H)),
    R("mtp_hnorm", "hnorm.weight", MTP, "mtp", "norm", "replicate", None, shape(H)),
    R("mtp_e_proj", "e_proj.weight", MTP, "mtp", "linear", "replicate", None,
      shape(H, H)),
    R("mtp_h_proj", "h_proj.weight", MTP, "mtp", "linear", "replicate", None,
      shape(H, H)),
    R("mtp_head_norm", "norm.weight", MTP, "mtp", "norm", "replicate", None, shape(H)),
    *_head_hc(MTP, ("hc_head_fn", "hc_head_base", "hc_head_scale")),
)  # fmt: skip


def hf_roles(roles: tuple[Role, ...]) -> tuple[Role, ...]:
    """``roles`` as transformers saves them: the attention's ``kv_norm`` written ``norm``."""
    rename = {"attn.kv_norm.weight": "attn.norm.weight"}
    return tuple(dataclasses.replace(r, pattern=rename.get(r.pattern, r.pattern)) for r in roles)
