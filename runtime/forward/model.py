"""A reference DeepSeek-V3 forward for one sequence, written from the model's definition, and
``DecoderReference``, the part every family's forward shares (``qwen3_moe.py`` is another).

The forward never touches a weight tensor itself. It asks a *weights provider* (``Weights``):

- ``linear(prefix, x)`` — ``x @ Wᵀ`` for the linear module ``prefix`` (HF name without
  ``.weight``, e.g. ``family.module("q_a", 0)``); a quantized backend or a TP rank substitutes
  its own kernel here;
- ``get(name)`` — a full tensor by HF name, for norms and the router;
- ``embed(tokens)`` — embedding rows of ``tokens`` (a vocab-parallel rank gathers them);
- ``experts(layer, x, topk_ids, topk_weights, limit=None)`` — the routed-expert sum of one MoE
  layer (``limit``: the SwiGLU clip, ``moe.swiglu``), so a CPU expert pool (or an EP rank) can
  take it over.

Every name comes from the config's family role table, by role (``ModelFamily.tensor`` /
``module``); ``DenseWeights(state, family)`` is the plain provider: float tensors under their
HF names. Below, roles stand for their tensors.

Per decoder layer ``l < num_hidden_layers`` (pre-norm, residual)::

    h = h + MLA(rmsnorm(h, attn_norm))
    h = h + FFN(rmsnorm(h, ffn_norm))     # the dense MLP if l is not a MoE layer

MLA (multi-head latent attention; H heads, dn = qk_nope, dr = qk_rope, dv = v_head dims)::

    q        = q_b(rmsnorm(q_a(x), q_a_norm))  or  q(x)    -> per head [dn | dr]
    [c | kr] = kv_a(x)                                      c: the latent, kr: [dr]
    [kn | v] = kv_b(rmsnorm(c, kv_a_norm))                  -> per head [dn | dv]
    k        = [kn | rope(kr)]  (kr shared by all heads),   q = [qn | rope(qr)]
    o        = softmax(q·kᵀ · s + causal) · v,   s = qk_head_dim^-0.5 · YaRN mscale²
    out      = o(o)

Then ``rmsnorm(h, final_norm)`` and ``lm_head``. RoPE and YaRN are in ``rope.py``, routing in
``moe.py``. RMSNorm is computed in float32 (float64 for float64 activations: ``precision.py``) with ``rms_norm_eps`` from the config for every norm
(DeepSeek's own code fixes 1e-6 for all of them, HF for the two latent norms; every released
config has ``rms_norm_eps = 1e-6``). The multi-token-prediction layers (layers
``L >= num_hidden_layers``) are not part of the main forward and are never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig, ModelFamily
from hetquant.formats.families.deepseek_v3 import DeepseekV3Config

from .moe import RouterSpec, gated_mlp, route, routed_experts
from .precision import work_dtype
from .rope import RopeSpec, apply_rope, cos_sin

__all__ = [
    "DecoderReference",
    "DeepseekV3Reference",
    "DenseWeights",
    "Weights",
    "check_runnable",
    "rms_norm",
]


class Weights(Protocol):
    """What the forward needs from the weights (see module docstring)."""

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor: ...

    def get(self, name: str) -> torch.Tensor: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def experts(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor: ...  # fmt: skip


class DenseWeights:
    """Unquantized weights: ``state`` maps HF tensor names to float tensors (bf16 / f32 / …) of
    a model of ``family`` (it names the embedding and the routed experts).

    ``linear`` casts a weight to the activation dtype when they differ (a no-op in the common case
    where both are the same). Override ``experts`` to move the routed experts elsewhere.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], family: ModelFamily) -> None:
        self.state, self.family = dict(state), family

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.state[name]
        except KeyError:
            raise HetquantError(f"weights: no tensor {name!r}") from None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.get(self.family.tensor("embed"))[tokens]  # [T, D]

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        w = self.get(f"{name}.weight")  # [out, in]
        return F.linear(x, w.to(x.dtype))  # [..., out]

    def experts(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        def modules(e: int) -> tuple[str, ...]:
            return self.family.mlp_modules("routed", layer, e)

        return routed_experts(self.linear, modules, x, topk_ids, topk_weights, limit)


def check_runnable(cfg: ModelConfig) -> None:
    """Refuse a model whose family the reference forward cannot run faithfully (its family's
    ``forward_refusal``): never a forward that silently leaves part of the model out."""
    why = cfg.family.forward_refusal
    if why:
        raise HetquantError(f"config.json: model_type {cfg.raw.get('model_type')!r}: {why}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim, in float32 (float64 for float64
    ``x``), returned in x's dtype."""
    wd = work_dtype(x.dtype)
    xw = x.to(wd)
    xw = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(wd) * xw).to(x.dtype)


class DecoderReference:
    """What every family's reference forward shares: causal prefill over one token sequence (no
    KV cache) — embedding, pre-norm residual decoder layers, final norm and lm_head, and the MoE
    block (router → ``weights.experts`` + shared experts where the layer holds them). A family's
    subclass sets ``rope`` (``RopeSpec``), ``router`` (``RouterSpec`` or None) and ``eps`` in its
    ``__init__`` and defines ``attention``. ``runtime/forward/references.py`` picks the subclass by
    family. Logits are float32. A family whose residual is not one [T, D] stream (DeepSeek-V4's
    hyper-connections) overrides the stage hooks ``hidden_shape``, ``embed_hidden``, ``context``
    (what its ``decoder_layer`` takes besides the layer and hidden states) and ``head``.
    """

    rope: RopeSpec
    router: RouterSpec | None
    # calib/forward.py's LayerRunner composes this family's layer from ``attention``, the norms
    # and a batched MoE (True), or runs ``decoder_layer`` one sequence at a time (False)
    composable: ClassVar[bool] = True
    limit: float | None = None  # the SwiGLU clip of its MLPs (moe.swiglu; DeepSeek-V4's)
    kv_caches: ClassVar[tuple[str, ...]] = ()  # KV-cache emulations it takes (kv_cache.py)

    def __init__(self, cfg: ModelConfig, weights: Weights, *, dtype: torch.dtype) -> None:
        raw = cfg.decoder_raw
        check_runnable(cfg)
        if raw.get("hidden_act", "silu") != "silu":
            raise HetquantError(f"config.json: hidden_act {raw['hidden_act']!r}; expected silu")
        self.cfg, self.weights, self.dtype, self.fam = cfg, weights, dtype, cfg.family
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        moe = any(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
        self.router = cfg.router() if moe else None  # type: ignore[attr-defined]

    # public API ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits float32 [T, vocab] for token ids ``tokens`` [T] (position t sees tokens ≤ t)."""
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise HetquantError(
                f"forward: expected a non-empty 1-D token tensor, got {tokens.shape}"
            )
        vocab = self.cfg.vocab_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise HetquantError(f"forward: token ids must lie in [0, {vocab})")
        h = self.embed_hidden(tokens)  # [T, D]
        ctx = self.context(tokens, h)
        for layer in range(self.cfg.num_hidden_layers):  # MTP layers excluded
            h = self.decoder_layer(layer, h, *ctx)
        return self.head(h)

    __call__ = forward

    # stage hooks (``runtime/serving/rank.py`` ``run_stage`` runs a pipeline stage with them) --
    def hidden_shape(self, t: int) -> tuple[int, ...]:
        """Shape of the hidden states of ``t`` tokens between layers: [T, D]."""
        return (t, self.cfg.hidden_size)

    def embed_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first layer's input for token ids ``tokens`` [T]: embeddings [T, D]."""
        return self.weights.embed(tokens).to(self.dtype)

    def context(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What ``decoder_layer`` takes after (layer, h): ``positions(h)``."""
        return self.positions(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, V] of the last hidden states ``h`` [T, D]: final norm, lm_head."""
        h = rms_norm(h, self.weights.get(self.fam.tensor("final_norm")), self.eps)  # [T, D]
        return self.weights.linear(self.fam.module("lm_head"), h).to(torch.float32)  # [T, V]

    def positions(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE ``cos``, ``sin`` [T, dr/2] and the causal mask [T, T] (0 on and below the
        diagonal, -inf above) for hidden states ``h`` [T, D], on ``h``'s device."""
        t = h.shape[0]
        wd = work_dtype(self.dtype)
        cos, sin = cos_sin(self.rope, torch.arange(t), wd)  # [T, dr/2] each, on the CPU
        mask = torch.full((t, t), float("-inf")).triu(1)  # [T, T]
        return cos.to(h.device), sin.to(h.device), mask.to(h.device)

    def generate(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy: append ``k`` argmax tokens (full re-prefill per step); returns [T + k]."""
        seq = tokens.to(torch.long)
        for _ in range(k):
            nxt = self.forward(seq)[-1].argmax()  # []
            seq = torch.cat([seq, nxt.reshape(1)])  # [T + i + 1]
        return seq

    def attention(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The family's attention of layer ``layer`` on normed ``x`` [T, D] → [T, D]."""
        raise NotImplementedError

    # one layer ------------------------------------------------------------------------------
    def decoder_layer(
        self,
        layer: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder layer ``layer`` on hidden states ``h`` [T, D]; returns [T, D]."""
        f, w = self.fam, self.weights
        x = rms_norm(h, w.get(f.tensor("attn_norm", layer)), self.eps)  # [T, D]
        h = h + self.attention(layer, x, cos, sin, mask)
        x = rms_norm(h, w.get(f.tensor("ffn_norm", layer)), self.eps)  # [T, D]
        if self.cfg.is_moe_layer(layer):
            return h + self.moe(layer, x)
        return h + gated_mlp(w.linear, f.mlp_modules(None, layer), x)

    def moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Routed experts (through ``weights.experts``) plus the shared experts the layer holds,
        [T, D] → [T, D]."""
        assert self.router is not None
        w, f = self.weights, self.fam
        wd = work_dtype(x.dtype)
        logits = F.linear(x.to(wd), w.get(f.tensor("router", layer)).to(wd))  # [T, E]
        bias = w.get(f.tensor("router_bias", layer)) if self.router.use_bias else None
        topk_ids, topk_weights = route(logits, bias, self.router)  # [T, k], [T, k]
        y = w.experts(layer, x, topk_ids, topk_weights)  # [T, D]
        shared = f.mlp("shared")
        if shared is not None and f.role(shared.gate) in f.layer_roles(self.cfg, layer):
            y = y + gated_mlp(w.linear, f.mlp_modules("shared", layer), x)
        return y


class DeepseekV3Reference(DecoderReference):
    """DeepSeek-V3 causal prefill over one token sequence (no KV cache).

    ``cfg`` is a ``DeepseekV3Config`` (a config of the DeepSeek-V3 family, or of one sharing its
    roles); ``weights`` a ``Weights`` provider; ``dtype`` the activation dtype. Logits are float32.
    """

    cfg: DeepseekV3Config

    def __init__(
        self, cfg: DeepseekV3Config, weights: Weights, *, dtype: torch.dtype = torch.float32
    ):
        if cfg.decoder_raw.get("attention_bias") or cfg.decoder_raw.get("tie_word_embeddings"):
            raise HetquantError(
                "config.json: attention_bias / tie_word_embeddings are not DeepSeek-V3 features"
            )
        super().__init__(cfg, weights, dtype=dtype)
        self.rope = RopeSpec.from_config(cfg.decoder_raw, cfg.qk_rope_head_dim)
        self.softmax_scale = cfg.qk_head_dim**-0.5 * self.rope.softmax_mscale

    def attention(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """MLA of layer ``layer`` on normed ``x`` [T, D] with rope angles ``cos``/``sin`` [T, dr/2]."""
        c, w, t = self.cfg, self.weights, x.shape[0]

        def m(role: str) -> str:
            return self.fam.module(role, layer)

        dn, dr, dv, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank:
            q_lat = rms_norm(
                w.linear(m("q_a"), x), w.get(self.fam.tensor("q_a_norm", layer)), self.eps
            )
            q = w.linear(m("q_b"), q_lat)  # [T, H·(dn+dr)]
        else:
            q = w.linear(m("q"), x)  # [T, H·(dn+dr)]
        nh = q.shape[-1] // (dn + dr)  # this rank's heads (all of them without TP)
        q = q.view(t, nh, dn + dr)  # [T, H, dn+dr]
        q_nope, q_rope = q.split([dn, dr], dim=-1)  # [T, H, dn], [T, H, dr]

        kv_a = w.linear(m("kv_a"), x)  # [T, r+dr]
        latent, k_rope = kv_a.split([r, dr], dim=-1)  # [T, r], [T, dr]
        latent = rms_norm(latent, w.get(self.fam.tensor("kv_a_norm", layer)), self.eps)  # [T, r]
        kv = w.linear(m("kv_b"), latent).view(t, nh, dn + dv)  # [T, H, dn+dv]
        k_nope, v = kv.split([dn, dv], dim=-1)  # [T, H, dn], [T, H, dv]

        q_rope = apply_rope(q_rope, cos, sin)  # [T, H, dr]
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)  # [T, 1, dr], shared by all heads
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, dn+dr]
        k = torch.cat([k_nope, k_rope.expand(t, nh, dr)], dim=-1)  # [T, H, dn+dr]

        scores = torch.einsum("thd,shd->hts", q, k) * self.softmax_scale  # [H, T(q), T(k)]
        probs = (scores + mask.to(scores.dtype)).softmax(-1, dtype=work_dtype(x.dtype)).to(x.dtype)
        o = torch.einsum("hts,shd->thd", probs, v)  # [T, H, dv]
        return w.linear(m("o"), o.reshape(t, nh * dv))  # [T, D]
