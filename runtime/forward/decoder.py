"""``DecoderReference``: what every family's reference forward shares (``model.py``'s
DeepSeek-V3, ``qwen3_moe.py``, ``deepseek_v4.py``), and the weights provider it asks.

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
``module``). ``rms_norm`` computes in float32 (float64 for float64 activations:
``precision.py``); ``check_runnable`` refuses a family the reference cannot run faithfully.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig

from .moe import RouterSpec, gated_mlp, route
from .precision import work_dtype
from .rope import RopeSpec, cos_sin

__all__ = ["DecoderReference", "Weights", "check_runnable", "rms_norm"]


class Weights(Protocol):
    """What the forward needs from the weights (see module docstring)."""

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor: ...

    def get(self, name: str) -> torch.Tensor: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def experts(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor: ...  # fmt: skip


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
