"""The DeepSeek-V4 family (V4-Flash, V4-Pro; ``model_type: deepseek_v4``): config and registration,
in two on-disk layouts — DeepSeek's own checkpoint and transformers' ``save_pretrained``.

Architecture (transformers 5.24 ``models/deepseek_v4/configuration_deepseek_v4.py``,
``modeling_deepseek_v4.py``): every decoder layer is MoE (``n_routed_experts`` experts of
``moe_intermediate_size``, top ``num_experts_per_tok``, ``n_shared_experts`` shared); its attention
is one of three types (``configuration_deepseek_v4.py:21-32``): ``sliding_attention`` (no
compressor), ``compressed_sparse_attention`` (CSA: a compressor of rate 4 and the lightning
indexer) or ``heavily_compressed_attention`` (HCA: a compressor of rate 128, no indexer); the
first layers route by a frozen token→expert table (``hash_moe``, ``ffn.gate.tid2eid``
[vocab, top_k], no router bias), the rest by top-k with ``ffn.gate.bias``
(``modeling_deepseek_v4.py:1085-1122``). Hyper-connections (``hc_mult`` streams) replace the
residual: per layer ``hc_{attn,ffn}_{fn,base,scale}``, and ``hc_head_*`` before the head.

Config keys, both spellings (``configuration_deepseek_v4.py:236-283``, its "legacy" kwargs are
DeepSeek's own config.json; vLLM 0.32 reads them, ``vllm/models/deepseek_v4/attention.py:233``,
``cpu/model.py:148``): the attention schedule is ``compress_ratios`` (DeepSeek: one int per main
layer, 0 / 4 / 128) or ``layer_types`` (transformers); the MoE schedule ``num_hash_layers`` or
``mlp_layer_types``. An attention ratio or a layer type not in those tables is refused, naming it.

Source precision: ``expert_dtype`` — top level (V4) or in ``quantization_config`` (V4.1; what
transformers 5.24 writes, ``configuration_deepseek_v4.py:245-254``) — is ``fp4`` (routed experts
in :mod:`..fp4_e2m1`) or ``fp8`` (V4-Flash-Base: :mod:`..fp8_block_scale` with F32 scales); the
other linears are block FP8 (``quant_method: fp8``, ``scale_fmt: ue8m0``). Another ``expert_dtype``
or ``scale_fmt`` is refused. Without ``quantization_config`` the source is BF16 (a fine-tune saved
by transformers). ``model_type: deepseek_v41`` (V4.1 nests the text model in ``text_config`` and
adds a vision tower: ``vllm/transformers_utils/configs/deepseek_v41.py``) is refused: its layout is
not read.

Layouts (``_deepseek_v4_roles.py`` has the tables): DeepSeek's (``layers.N.attn.wq_a``,
``embed.weight``, ``head.weight``, the MTP layer under ``mtp.0.``) when config.json gives
``compress_ratios``; transformers' (``model.layers.N.…``, ``model.embed_tokens.weight``,
``model.hc_head.hc_fn``, ``head.weight``; ``attn.kv_norm`` written as ``attn.norm``; no MTP layer,
which transformers does not instantiate) when it gives ``layer_types``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import HetquantError
from ._deepseek_v4_roles import HF_GLOBALS, LAYER_ROLES, MTP_ROLES, NATIVE_GLOBALS, hf_roles
from .base import ModelConfig, ModelFamily, register_family
from .fields import ConfigFields, source_quantization
from .mappings import AwqMappings

__all__ = ["ATTENTION_TYPES", "FAMILY", "FAMILY_HF", "DeepseekV4Config", "DeepseekV4HfConfig"]

# compress ratio → attention type (configuration_deepseek_v4.py:28-32) and the type's scope
ATTENTION_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                   128: "heavily_compressed_attention"}  # fmt: skip
_SCOPE = {"sliding_attention": "swa", "compressed_sparse_attention": "csa",
          "heavily_compressed_attention": "hca"}  # fmt: skip
MLP_TYPES = {"hash_moe": "hash", "moe": "topk"}
EXPERT_DTYPES = ("fp4", "fp8")
_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_REQUIRED = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "head_dim",
             "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim")  # fmt: skip
_HINT = "is this a DeepSeek-V4 config?"


@dataclass(frozen=True)
class DeepseekV4Config(ModelConfig):
    """The fields of a DeepSeek-V4 config.json that conversion and loading need (module docstring)."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    num_mtp_layers: int
    attention: tuple[str, ...]  # per main layer: swa | csa | hca (scopes)
    mlp: tuple[str, ...]  # per main layer: hash | topk
    rates: tuple[tuple[str, int], ...]  # (scope, compress rate) of csa / hca
    expert_dtype: str | None  # fp4 | fp8 | None (BF16 source)
    weight_block_size: tuple[int, int] | None
    rms_norm_eps: float
    raw: dict[str, Any]

    @classmethod
    def parse(cls, raw: dict[str, Any], origin: str = "config.json") -> DeepseekV4Config:
        f = ConfigFields(raw, origin)
        f.require(_REQUIRED, _HINT)
        v = {k: f.integer(k) for k in _REQUIRED}
        n = v["num_hidden_layers"]
        heads, groups = v["num_attention_heads"], v["o_groups"]
        if heads % groups:
            raise HetquantError(f"{origin}: num_attention_heads {heads} is not a multiple of "
                                f"o_groups {groups}")  # fmt: skip
        if v["num_experts_per_tok"] > v["n_routed_experts"]:
            raise f.fail("num_experts_per_tok", v["num_experts_per_tok"],
                         f"at most n_routed_experts ({v['n_routed_experts']})")  # fmt: skip
        rates = f.mapping("compress_rates")
        rate = {_SCOPE[t]: rates.integer(t, d) for t, d in _RATES.items()}
        return cls(
            **v, n_shared_experts=f.integer("n_shared_experts", 1, lo=0),
            hc_mult=f.integer("hc_mult", 4), num_mtp_layers=cls._mtp_layers(f),
            attention=_attention(f, n), mlp=_mlp(f, n), rates=tuple(sorted(rate.items())),
            expert_dtype=_expert_dtype(f), weight_block_size=source_quantization(f),
            rms_norm_eps=f.number("rms_norm_eps", 1e-6), raw=raw,
        )  # fmt: skip

    @classmethod
    def _mtp_layers(cls, f: ConfigFields) -> int:
        return f.integer("num_nextn_predict_layers", 0, lo=0)

    # generic facts ---------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def tp_head_counts(self) -> tuple[int, ...]:
        return (self.num_attention_heads, self.o_groups)

    def is_moe_layer(self, layer: int) -> bool:
        return True  # every V4 layer, the MTP layer too

    def layer_scopes(self, layer: int) -> frozenset[str]:
        shared = {"shared"} if self.n_shared_experts else set()
        if layer >= self.num_hidden_layers:  # the MTP block: sliding attention, top-k MoE
            return frozenset({"layer", "swa", "topk", *shared})  # vllm attention.py:232-235
        return frozenset({"layer", self.attention[layer], self.mlp[layer], *shared})

    @classmethod
    def without_mtp(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "num_nextn_predict_layers": 0}

    # the role table's ------------------------------------------------------------------------
    def rate(self, scope: str) -> int:
        return dict(self.rates)[scope]

    @property
    def streams(self) -> int:
        """Rows of a hyper-connection ``fn``: pre (n), post (n) and comb (n·n) weights."""
        return (2 + self.hc_mult) * self.hc_mult


@dataclass(frozen=True)
class DeepseekV4HfConfig(DeepseekV4Config):
    """The same config as transformers saves it: no MTP layer in the weights (transformers does
    not instantiate it, ``configuration_deepseek_v4.py`` ``num_nextn_predict_layers``)."""

    @classmethod
    def _mtp_layers(cls, f: ConfigFields) -> int:
        return 0


def _attention(f: ConfigFields, n: int) -> tuple[str, ...]:
    if f.raw.get("compress_ratios") is not None:
        ratios = f.integers("compress_ratios", lo=0)
        if len(ratios) < n:
            raise f.fail("compress_ratios", ratios, f"one ratio per layer ({n})")
        for i, r in enumerate(ratios[:n]):
            if r not in ATTENTION_TYPES:
                raise HetquantError(
                    f"{f.origin}: compress_ratios[{i}] = {r} is no DeepSeek-V4 attention type "
                    f"hetquant knows (ratios {sorted(ATTENTION_TYPES)})"
                )
        return tuple(_SCOPE[ATTENTION_TYPES[r]] for r in ratios[:n])
    return _named(f, "layer_types", _SCOPE, n)


def _mlp(f: ConfigFields, n: int) -> tuple[str, ...]:
    if f.raw.get("mlp_layer_types") is not None:
        return _named(f, "mlp_layer_types", MLP_TYPES, n)
    hashed = f.integer("num_hash_layers", 3, lo=0)  # configuration_deepseek_v4.py:153
    return tuple("hash" if i < hashed else "topk" for i in range(n))


def _named(f: ConfigFields, key: str, known: Mapping[str, str], n: int) -> tuple[str, ...]:
    """Per-layer type names of ``key`` as scopes, each one of ``known``."""
    types = f.texts(key, None)
    if types is None:
        raise HetquantError(f"{f.origin}: neither compress_ratios (DeepSeek's config) nor "
                            f"{key} (transformers') is given; {_HINT}")  # fmt: skip
    if len(types) < n:
        raise f.fail(key, types, f"one entry per layer ({n})")
    for i, t in enumerate(types[:n]):
        if t not in known:
            raise HetquantError(f"{f.origin}: {key}[{i}] = {t!r} is a layer type hetquant does "
                                f"not know (DeepSeek-V4 has {', '.join(known)})")  # fmt: skip
    return tuple(known[t] for t in types[:n])


def _expert_dtype(f: ConfigFields) -> str | None:
    qc = f.mapping("quantization_config")  # an artifact's config names its own method
    fmt = qc.text("scale_fmt", None)
    if qc.raw.get("quant_method") == "fp8" and fmt not in (None, "ue8m0"):
        raise qc.fail("scale_fmt", fmt, "ue8m0 (the scale format DeepSeek-V4 ships)")
    top, nested = f.raw.get("expert_dtype"), qc.raw.get("expert_dtype")
    if top is not None and nested is not None and top != nested:
        raise HetquantError(f"{f.origin}: expert_dtype {top!r} and quantization_config."
                            f"expert_dtype {nested!r} disagree")  # fmt: skip
    if top is not None:
        return f.text("expert_dtype", None, EXPERT_DTYPES)
    return qc.text("expert_dtype", None, EXPERT_DTYPES)  # None: not declared


def _is_hf_layout(raw: Mapping[str, Any]) -> bool:
    """transformers' save_pretrained writes ``layer_types``; DeepSeek's config ``compress_ratios``."""
    return raw.get("compress_ratios") is None and raw.get("layer_types") is not None


_NO_AWQ = AwqMappings(balances=(), clips=(), mlp_input=None)
_REFUSED_TYPES = (("deepseek_v41", "DeepSeek-V4.1 nests its text model in text_config and adds a "
                   "vision tower, a layout hetquant does not read yet; convert DeepSeek-V4"),)  # fmt: skip
FAMILY = register_family(
    ModelFamily(
        "deepseek_v4", DeepseekV4Config, NATIVE_GLOBALS + LAYER_ROLES + MTP_ROLES, _NO_AWQ,
        model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",),
        layer_prefix="layers.{layer}.", mtp_prefix="mtp.{mtp}.",
        refused_types=_REFUSED_TYPES, accepts=lambda raw: not _is_hf_layout(raw),
    )
)  # fmt: skip
FAMILY_HF = register_family(
    ModelFamily(
        "deepseek_v4_hf", DeepseekV4HfConfig, HF_GLOBALS + hf_roles(LAYER_ROLES), _NO_AWQ,
        model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",),
        accepts=_is_hf_layout,
    )
)  # fmt: skip
