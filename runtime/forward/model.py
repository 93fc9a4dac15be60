"""A reference DeepSeek-V3 forward for one sequence, written from the model's definition
(``DeepseekV3Reference``), and ``DenseWeights``, the plain weights provider.

What every family's forward shares is in ``decoder.py`` and re-exported here: ``DecoderReference``
(``qwen3_moe.py`` and ``deepseek_v4.py`` are other families), the weights provider it asks
(``Weights``), ``rms_norm`` and ``check_runnable``.

``DenseWeights(state, family)`` is the plain provider: float tensors under their HF names.
Below, roles stand for their tensors.

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

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelFamily
from hetquant.formats.families.deepseek_v3 import DeepseekV3Config

from .decoder import DecoderReference, Weights, check_runnable, rms_norm
from .moe import routed_experts
from .precision import work_dtype
from .rope import RopeSpec, apply_rope

__all__ = [
    "DecoderReference",
    "DeepseekV3Reference",
    "DenseWeights",
    "Weights",
    "check_runnable",
    "rms_norm",
]


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
