"""A reference DeepSeek-V4 forward for one sequence, checked against transformers 5.24's
``DeepseekV4ForCausalLM`` (``tests/runtime/forward/test_deepseek_v4_forward.py``; line numbers
below are ``models/deepseek_v4/modeling_deepseek_v4.py``'s).

The residual is ``hc_mult`` streams ``h`` [T, n, D] (hyper-connections, ``hyper.py``)::

    h = embed(tokens) repeated over the n streams                          (1350-1357)
    per layer l (1175-1200):
        x, post, comb = hc_weights(h, hc_attn_*);  h = post ⊗ attn_l(rmsnorm(x, attn_norm)) + combᵀh
        x, post, comb = hc_weights(h, hc_ffn_*);   h = post ⊗ moe_l(rmsnorm(x, ffn_norm)) + combᵀh
    logits = head(rmsnorm(hc_head(h), final_norm))                         (1373, 1531)

``attn_l`` is sliding-window, CSA or HCA by the config's schedule (``v4_attention.py``). The MoE
(1077-1147): ``s = sqrt(softplus(x · routerᵀ))`` (``scoring_func: sqrtsoftplus``, the only one
read); a ``hash`` layer takes the experts ``tid2eid[token]``, a ``topk`` layer the top-k of
``s + router_bias``; weights ``s[ids] / (Σ s[ids] + 1e-20) · routed_scaling_factor`` (always
renormalised, as transformers does whatever ``norm_topk_prob`` says); routed experts through
``Weights.experts`` and the shared expert, both SwiGLU clipped at ``swiglu_limit``
(``moe.swiglu``). Layers run in the activation dtype with norms, softmaxes, rope and routing in
float32 (``precision.py``). The MTP layer (DeepSeek's ``mtp.0.``, kept or dropped by the
converter) is not part of the forward, as in transformers (``_keys_to_ignore_on_load_unexpected``).

Config (both spellings, ``formats/families/deepseek_v4.py``): the ``main`` rope is ``rope_theta``
without scaling, the ``compress`` rope ``compress_rope_theta`` with ``rope_scaling`` (YaRN: its
frequencies, no magnitude factor — transformers forces ``attention_factor`` 1,
``configuration_deepseek_v4.py:292-319``), or ``rope_parameters.{main,compress}`` as
transformers saves them; rope dims ``qk_rope_head_dim`` or ``head_dim · partial_rotary_factor``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families.deepseek_v4 import DeepseekV4Config
from hetquant.formats.families.fields import ConfigFields

from .hyper import HyperSpec, hc_expand, hc_head, hc_weights
from .kv_cache import KV_CACHES
from .kv_cache import kv_cache as emulate_kv_cache
from .model import DecoderReference, Weights, check_runnable, rms_norm
from .moe import gated_mlp
from .precision import work_dtype
from .rope import RopeSpec
from .v4_attention import AttentionSpec, Positions, attention

__all__ = ["DeepseekV4Reference", "attention_spec"]

_ROUTE_EPS = 1e-20  # modeling_deepseek_v4.py:1094, 1125


def _rope(raw: dict[str, Any], which: str, dim: int) -> RopeSpec:
    """The ``main`` or ``compress`` rope of a V4 config (module docstring)."""
    f = ConfigFields(raw, "config.json")
    nested = raw.get("rope_parameters")
    is_nested = isinstance(nested, dict) and isinstance(nested.get(which), dict)
    if is_nested:
        scaling = f.mapping("rope_parameters").mapping(which)
        theta = scaling.number("rope_theta", positive=True)
    else:
        theta = f.number("rope_theta" if which == "main" else "compress_rope_theta",
                         10000.0 if which == "main" else 160000.0, positive=True)  # fmt: skip
        if which == "main":
            return RopeSpec(dim, theta)  # configuration_deepseek_v4.py:306-310: always plain
        scaling = f.mapping("rope_scaling" if raw.get("rope_scaling") else "rope_parameters")
    kind = scaling.text("rope_type", scaling.text("type", "default"))
    if kind == "default":
        return RopeSpec(dim, theta)
    # transformers sets attention_factor 1 when it nests a flat config (so a saved config has
    # it); a nested one without it would get YaRN's magnitude factor, which is not read here
    factor = scaling.number("attention_factor", None if is_nested else 1.0)
    if factor != 1.0:
        raise HetquantError(f"config.json: the {which} rope's attention_factor is {factor}, not "
                            "1; the DeepSeek-V4 forward reads YaRN without a magnitude factor")  # fmt: skip
    yarn = {k: scaling.raw[k] for k in ("factor", "original_max_position_embeddings",
                                        "beta_fast", "beta_slow") if k in scaling.raw}  # fmt: skip
    yarn |= {"type": kind, "mscale": 0.0, "mscale_all_dim": 0.0}  # m(·) = 1: no magnitude factor
    return RopeSpec.from_config({"rope_theta": theta, "rope_scaling": yarn}, dim)


def attention_spec(cfg: DeepseekV4Config) -> AttentionSpec:
    """The attention's constants from ``cfg`` (its config.json fields, checked)."""
    raw = cfg.decoder_raw
    f = ConfigFields(raw, "config.json")
    if raw.get("qk_rope_head_dim") is not None:
        rd = f.integer("qk_rope_head_dim")
    else:
        rd = int(cfg.head_dim * f.number("partial_rotary_factor", 64 / 512, positive=True))
    if rd % 2 or rd > cfg.head_dim:
        raise HetquantError(f"config.json: rope dims {rd} must be even and at most head_dim "
                            f"{cfg.head_dim}")  # fmt: skip
    return AttentionSpec(
        heads=cfg.num_attention_heads, head_dim=cfg.head_dim, o_groups=cfg.o_groups,
        rope_dim=rd, window=f.integer("sliding_window", 128), rates=dict(cfg.rates),
        index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
        index_topk=f.integer("index_topk", 512), eps=cfg.rms_norm_eps,
        main=_rope(raw, "main", rd), compress=_rope(raw, "compress", rd),
    )  # fmt: skip


class DeepseekV4Reference(DecoderReference):
    """DeepSeek-V4 causal prefill over one token sequence (module docstring)."""

    cfg: DeepseekV4Config
    composable = False  # hyper-connections, per-sequence compressors: LayerRunner runs our layer

    kv_caches = tuple(KV_CACHES)  # decoder.DecoderReference: the KV-cache emulations it takes

    def __init__(
        self, cfg: DeepseekV4Config, weights: Weights, *, dtype: torch.dtype = torch.float32,
        kv_cache: str | None = None,
    ) -> None:  # fmt: skip
        check_runnable(cfg)
        raw = cfg.decoder_raw
        f = ConfigFields(raw, "config.json")
        f.text("hidden_act", "silu", ("silu",))
        f.text("scoring_func", "sqrtsoftplus", ("sqrtsoftplus",))
        if raw.get("tie_word_embeddings"):
            raise HetquantError("config.json: tie_word_embeddings is not a DeepSeek-V4 feature")
        self.cfg, self.weights, self.dtype, self.fam = cfg, weights, dtype, cfg.family
        self.eps, self.router = cfg.rms_norm_eps, None  # V4 routes in ``moe`` below
        self.spec = replace(attention_spec(cfg), kv_cache=emulate_kv_cache(kv_cache))
        self.rope = self.spec.main
        self.hyper = HyperSpec(cfg.hc_mult, f.integer("hc_sinkhorn_iters", 20),
                               f.number("hc_eps", 1e-6), cfg.rms_norm_eps)  # fmt: skip
        self.limit = f.number("swiglu_limit", 10.0, positive=True)
        self.scaling = f.number("routed_scaling_factor", 1.5, positive=True)

    # stage hooks (model.DecoderReference) --------------------------------------------------
    def hidden_shape(self, t: int) -> tuple[int, ...]:
        return (t, self.cfg.hc_mult, self.cfg.hidden_size)

    def embed_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, D] repeated over the ``hc_mult`` streams: [T, n, D]."""
        h = self.weights.embed(tokens).to(self.dtype)  # [T, D]
        return h[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()

    def context(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[Any, ...]:
        """(token ids [T] for the hash-routed layers, the sequence's ``Positions``)."""
        return tokens, Positions.build(self.spec, h.shape[0], self.dtype, h.device)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        w, f = self.weights, self.fam
        x = hc_head(h, *(w.get(f.tensor(f"hc_head_{p}")) for p in ("fn", "base", "scale")),
                    self.hyper)  # fmt: skip
        x = rms_norm(x, w.get(f.tensor("final_norm")), self.eps)  # [T, D]
        return w.linear(f.module("lm_head"), x).to(torch.float32)  # [T, V]

    # one layer ------------------------------------------------------------------------------
    def decoder_layer(  # type: ignore[override]
        self, layer: int, h: torch.Tensor, tokens: torch.Tensor, at: Positions
    ) -> torch.Tensor:
        """Decoder layer ``layer`` on the streams ``h`` [T, n, D] → [T, n, D]."""
        w, f = self.weights, self.fam
        x, post, comb = hc_weights(h, *self._hc("attn", layer), self.hyper)  # [T, D]
        x = rms_norm(x, w.get(f.tensor("attn_norm", layer)), self.eps)
        y = attention(w, f, layer, self.cfg.attention[layer], x, at, self.spec)
        h = hc_expand(h, y, post, comb)
        x, post, comb = hc_weights(h, *self._hc("ffn", layer), self.hyper)
        x = rms_norm(x, w.get(f.tensor("ffn_norm", layer)), self.eps)
        return hc_expand(h, self.moe(layer, x, tokens), post, comb)  # type: ignore[call-arg]

    def _hc(self, block: str, layer: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.weights.get(self.fam.tensor(f"hc_{block}_{p}", layer))
                     for p in ("fn", "base", "scale"))  # fmt: skip

    def moe(self, layer: int, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Routed experts (``weights.experts``) plus the shared expert, [T, D] → [T, D]."""
        w, f, k = self.weights, self.fam, self.cfg.num_experts_per_tok
        wd = work_dtype(x.dtype)
        logits = F.linear(x.to(wd), w.get(f.tensor("router", layer)).to(wd))  # [T, E]
        scores = F.softplus(logits).sqrt()
        if self.cfg.mlp[layer] == "hash":
            if tokens.shape != x.shape[:1]:
                raise HetquantError(f"layer {layer} routes by token id: give the token ids")
            ids = w.get(f.tensor("hash_table", layer)).to(x.device)[tokens].long()  # [T, k]
        else:
            bias = w.get(f.tensor("router_bias", layer)).to(wd)
            ids = torch.topk(scores + bias, k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _ROUTE_EPS) * self.scaling
        y = w.experts(layer, x, ids, weights, limit=self.limit)
        if self.cfg.n_shared_experts:
            y = y + gated_mlp(w.linear, f.mlp_modules("shared", layer), x, self.limit)
        return y
