"""A reference Qwen3-MoE forward for one sequence, checked against transformers'
``Qwen3MoeForCausalLM`` (``tests/runtime/test_qwen3_moe.py``).

It shares everything but attention with the DeepSeek-V3 reference (``model.py``
``DecoderReference``: embedding, pre-norm residual layers, the MoE block, final norm, lm_head;
the same ``Weights`` providers, so TP/PP/EP ranks and the CPU expert pool work unchanged). Roles
stand for their tensors (``formats/families/qwen3_moe.py``). Per layer (transformers 5.23
``modeling_qwen3_moe.py`` ``Qwen3MoeAttention.forward``, ``Qwen3MoeSparseMoeBlock``)::

    q = rmsnorm_per_head(q(x), q_norm)        [T, Hq, d]     (d = head_dim, RMSNorm over d)
    k = rmsnorm_per_head(k(x), k_norm)        [T, Hkv, d]
    v = v(x)                                  [T, Hkv, d]
    q, k = rope(q), rope(k)                   half-split layout: [x1 | x2] → [x1·c − x2·s | x2·c + x1·s]
    o = softmax(q·kᵀ / √d + causal) · v       query head h reads KV head h // (Hq / Hkv)
    out = o(o)

    moe: p = softmax(x · routerᵀ) (fp32), top-k, renormalised iff norm_topk_prob; Σ p_k · expert_k(x)

Under TP each rank holds Hq/tp query and Hkv/tp KV heads (the role table splits q/k/v by rows),
so the local group mapping is the global one; the layout refuses a TP size that does not divide
both head counts (KV-head replication is not implemented). RoPE: plain (``rope_theta``);
``rope_scaling`` (YaRN as Qwen documents it for long context) is refused here — transformers'
YaRN differs from DeepSeek's, which ``rope.py`` implements. Sliding-window attention
(``use_sliding_window``, off in every released Qwen3-MoE) is refused too.
"""

from __future__ import annotations

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families.qwen3_moe import Qwen3MoeConfig

from .model import DecoderReference, Weights, rms_norm
from .precision import work_dtype
from .rope import RopeSpec

__all__ = ["Qwen3MoeReference", "apply_rope_half"]


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, d] by angles ``cos``/``sin`` [T, d/2] in the half-split layout:
    channel i pairs with i + d/2 (transformers' ``rotate_half``); computed in float32 (float64
    for float64 ``x``), returns x's dtype."""
    x1, x2 = x.to(work_dtype(x.dtype)).chunk(2, dim=-1)  # [T, H, d/2] each
    cos, sin = cos.to(x1.dtype), sin.to(x1.dtype)
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)  # [T, H, d]


class Qwen3MoeReference(DecoderReference):
    """Qwen3-MoE causal prefill over one token sequence (module docstring)."""

    cfg: Qwen3MoeConfig

    def __init__(
        self, cfg: Qwen3MoeConfig, weights: Weights, *, dtype: torch.dtype = torch.float32
    ):
        raw = cfg.decoder_raw
        bad = [k for k in ("attention_bias", "tie_word_embeddings", "use_sliding_window")
               if raw.get(k)]  # fmt: skip
        if raw.get("rope_scaling"):
            bad.append("rope_scaling")
        if bad:
            raise HetquantError(
                f"config.json: {', '.join(bad)} set; the reference Qwen3-MoE forward supports "
                "none of them (no released Qwen3-MoE config sets them)"
            )
        super().__init__(cfg, weights, dtype=dtype)
        self.rope = RopeSpec.from_config(raw, cfg.head_dim, default_theta=1e6)  # no scaling
        self.softmax_scale = cfg.head_dim**-0.5

    def attention(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """GQA of layer ``layer`` on normed ``x`` [T, D] with rope angles ``cos``/``sin`` [T, d/2]."""
        w, f, t, d = self.weights, self.fam, x.shape[0], self.cfg.head_dim

        def heads(role: str, norm: str | None) -> torch.Tensor:
            y = w.linear(f.module(role, layer), x)  # [T, H_r·d] (this rank's heads)
            y = y.view(t, -1, d)  # [T, H_r, d]
            return y if norm is None else rms_norm(y, w.get(f.tensor(norm, layer)), self.eps)

        q = apply_rope_half(heads("q", "q_norm"), cos, sin)  # [T, Hq_r, d]
        k = apply_rope_half(heads("k", "k_norm"), cos, sin)  # [T, Hkv_r, d]
        v = heads("v", None)  # [T, Hkv_r, d]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [T, Hq_r, d]: query head h reads KV head h // g
        v = v.repeat_interleave(group, dim=1)  # [T, Hq_r, d]
        scores = torch.einsum("thd,shd->hts", q, k) * self.softmax_scale  # [Hq_r, T(q), T(k)]
        probs = (scores + mask.to(scores.dtype)).softmax(-1, dtype=work_dtype(x.dtype)).to(x.dtype)
        o = torch.einsum("hts,shd->thd", probs, v)  # [T, Hq_r, d]
        return w.linear(f.module("o", layer), o.reshape(t, -1))  # [T, D]
