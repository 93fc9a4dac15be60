"""The training module of ``train.py``: DeepSeek-V3 (MLA, YaRN, noaux_tc MoE, MTP) over a batch.

``Model`` computes what ``hetquant.runtime.forward.model.DeepseekV3Reference`` computes, batched and with
the routed experts stacked (tokens sorted by expert, one matmul pair per expert), so that it
trains at a useful speed; ``train.py`` checks the two agree before it writes a checkpoint.
Parameters are created as zeros (norms: ones); ``train.init_weights`` draws the initial values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetquant.formats.families import ModelConfig
from hetquant.runtime.forward.model import rms_norm
from hetquant.runtime.forward.rope import RopeSpec, cos_sin

__all__ = ["Model", "rope_batched"]


def _key(name: str) -> str:
    return name.replace(".", "/")


def rope_batched(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``runtime.rope.apply_rope`` for ``x`` [B, T, ..., d] (interleaved pairs, float32 math)."""
    t, d = x.shape[1], x.shape[-1]
    pairs = x.float().reshape(*x.shape[:-1], d // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    shape = (1, t) + (1,) * (x.ndim - 3) + (d // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return out.reshape(x.shape).to(x.dtype)


class Model(nn.Module):
    """DeepSeek-V3 (MLA, YaRN, noaux_tc MoE, MTP) over a batch [B, T], for training.

    Parameters live under their HF names (``.`` → ``/`` for ``nn.ParameterDict``), except the
    routed experts of MoE layer ``L``: ``model.layers.L.mlp.experts.gate_up`` [E, 2I, H] (gate
    rows then up rows) and ``...experts.down`` [E, H, I]. ``hf_state`` / ``load_hf_state``
    convert to and from the checkpoint's names. ``e_score_correction_bias`` are buffers.
    """

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.raw = config
        self.cfg = c = ModelConfig.from_dict(config)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.rope = RopeSpec.from_config(config, c.qk_rope_head_dim)
        self.scale = c.qk_head_dim**-0.5 * self.rope.softmax_mscale
        self.top_k = int(config["num_experts_per_tok"])
        self.n_group, self.topk_group = int(config["n_group"]), int(config["topk_group"])
        self.routed_scale = float(config["routed_scaling_factor"])
        self.p = nn.ParameterDict()
        self.loads: dict[int, torch.Tensor] = {}  # MoE layer -> expert token counts, last forward
        for name, shape, kind in self.param_specs():
            t = torch.ones(shape) if kind == "norm" else torch.zeros(shape)
            self.p[_key(name)] = nn.Parameter(t)
        for layer in self.moe_layers:
            self.register_buffer(f"bias_{layer}", torch.zeros(c.n_routed_experts))

    # names ------------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.cfg.total_layers) if self.cfg.is_moe_layer(i)]

    def param_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, kind) of every parameter; kind: norm | out | in."""
        c = self.cfg
        h, heads = c.hidden_size, c.num_attention_heads
        dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        specs = [("model.embed_tokens.weight", (c.vocab_size, h), "in")]
        for layer in range(c.total_layers):
            p = f"model.layers.{layer}"
            a = f"{p}.self_attn"
            specs += [
                (f"{p}.input_layernorm.weight", (h,), "norm"),
                (f"{a}.q_a_proj.weight", (c.q_lora_rank, h), "in"),
                (f"{a}.q_a_layernorm.weight", (c.q_lora_rank,), "norm"),
                (f"{a}.q_b_proj.weight", (heads * (dn + dr), c.q_lora_rank), "in"),
                (f"{a}.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + dr, h), "in"),
                (f"{a}.kv_a_layernorm.weight", (c.kv_lora_rank,), "norm"),
                (f"{a}.kv_b_proj.weight", (heads * (dn + dv), c.kv_lora_rank), "in"),
                (f"{a}.o_proj.weight", (h, heads * dv), "out"),
                (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
            ]
            if c.is_moe_layer(layer):
                e, i = c.n_routed_experts, c.moe_intermediate_size
                si = i * c.n_shared_experts
                specs += [
                    (f"{p}.mlp.gate.weight", (e, h), "in"),
                    (f"{p}.mlp.experts.gate_up", (e, 2 * i, h), "in"),
                    (f"{p}.mlp.experts.down", (e, h, i), "out"),
                    (f"{p}.mlp.shared_experts.gate_proj.weight", (si, h), "in"),
                    (f"{p}.mlp.shared_experts.up_proj.weight", (si, h), "in"),
                    (f"{p}.mlp.shared_experts.down_proj.weight", (h, si), "out"),
                ]
            else:
                i = c.intermediate_size
                specs += [
                    (f"{p}.mlp.gate_proj.weight", (i, h), "in"),
                    (f"{p}.mlp.up_proj.weight", (i, h), "in"),
                    (f"{p}.mlp.down_proj.weight", (h, i), "out"),
                ]
            if layer in c.mtp_layer_ids:
                specs += [
                    (f"{p}.enorm.weight", (h,), "norm"),
                    (f"{p}.hnorm.weight", (h,), "norm"),
                    (f"{p}.eh_proj.weight", (h, 2 * h), "in"),
                    (f"{p}.shared_head.norm.weight", (h,), "norm"),
                ]
        specs += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (c.vocab_size, h), "in")]
        return specs

    def w(self, name: str) -> torch.Tensor:
        return self.p[_key(name)]

    def bias(self, layer: int) -> torch.Tensor:
        return getattr(self, f"bias_{layer}")

    @torch.no_grad()
    def hf_state(self) -> dict[str, torch.Tensor]:
        """float32 CPU tensors under the checkpoint's names (MTP embed / head as copies)."""
        c, out = self.cfg, {}
        for name, _, _ in self.param_specs():
            t = self.w(name).detach().float().cpu()
            if name.endswith("experts.gate_up"):
                prefix, i = name[: -len("gate_up")], c.moe_intermediate_size
                for e in range(c.n_routed_experts):
                    out[f"{prefix}{e}.gate_proj.weight"] = t[e, :i].clone()
                    out[f"{prefix}{e}.up_proj.weight"] = t[e, i:].clone()
            elif name.endswith("experts.down"):
                prefix = name[: -len("down")]
                for e in range(c.n_routed_experts):
                    out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
            else:
                out[name] = t.clone()
        for layer in self.moe_layers:
            out[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = (
                self.bias(layer).detach().float().cpu().clone()
            )
        for layer in c.mtp_layer_ids:
            out[f"model.layers.{layer}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
            out[f"model.layers.{layer}.shared_head.head.weight"] = out["lm_head.weight"]
        return out

    @torch.no_grad()
    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of ``hf_state`` (the MTP copies of embed / head are not read)."""
        c = self.cfg
        for name, _, _ in self.param_specs():
            dst = self.w(name)
            if name.endswith("experts.gate_up"):
                prefix = name[: -len("gate_up")]
                src = torch.stack(
                    [
                        torch.cat(
                            [
                                state[f"{prefix}{e}.gate_proj.weight"],
                                state[f"{prefix}{e}.up_proj.weight"],
                            ]
                        )
                        for e in range(c.n_routed_experts)
                    ]
                )
            elif name.endswith("experts.down"):
                prefix = name[: -len("down")]
                src = torch.stack(
                    [state[f"{prefix}{e}.down_proj.weight"] for e in range(c.n_routed_experts)]
                )
            else:
                src = state[name]
            dst.copy_(src.to(dst.dtype))
        for layer in self.moe_layers:
            self.bias(layer).copy_(state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])

    # forward ----------------------------------------------------------------------------------
    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w(f"{name}.weight"))

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w(f"{name}.weight"), self.eps)

    def attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c, p = self.cfg, f"model.layers.{layer}.self_attn"
        b, t = x.shape[:2]
        nh, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.linear(
            f"{p}.q_b_proj", self.norm(f"{p}.q_a_layernorm", self.linear(f"{p}.q_a_proj", x))
        )
        q_nope, q_rope = q.view(b, t, nh, dn + dr).split([dn, dr], dim=-1)
        latent, k_rope = self.linear(f"{p}.kv_a_proj_with_mqa", x).split([c.kv_lora_rank, dr], -1)
        kv = self.linear(f"{p}.kv_b_proj", self.norm(f"{p}.kv_a_layernorm", latent))
        k_nope, v = kv.view(b, t, nh, dn + dv).split([dn, dv], dim=-1)
        q = torch.cat([q_nope, rope_batched(q_rope, cos, sin)], dim=-1)  # [B, T, H, dn+dr]
        k_rope = rope_batched(k_rope.unsqueeze(2), cos, sin).expand(b, t, nh, dr)
        k = torch.cat([k_nope, k_rope], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
        )  # [B, H, T, dv]
        return self.linear(f"{p}.o_proj", o.transpose(1, 2).reshape(b, t, nh * dv))

    def mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(f"{prefix}.gate_proj", x), self.linear(f"{prefix}.up_proj", x)
        return self.linear(f"{prefix}.down_proj", F.silu(gate) * up)

    def route(self, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``runtime.moe.route`` (sigmoid, noaux_tc, groups, normalized, scaled), any device."""
        n, e = logits.shape
        scores = logits.sigmoid()  # [N, E] float32
        choice = scores + bias
        if self.n_group > 1:
            grouped = choice.view(n, self.n_group, e // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            kept = group_score.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
            keep = keep.repeat_interleave(e // self.n_group, dim=1)  # [N, E]
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights * self.routed_scale

    def moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Routed experts (tokens sorted by expert, one matmul pair each) + shared expert."""
        p, shape = f"model.layers.{layer}.mlp", x.shape
        xf = x.reshape(-1, shape[-1])  # [N, D]
        with torch.autocast(xf.device.type, enabled=False):
            logits = F.linear(xf.float(), self.w(f"{p}.gate.weight").float())  # [N, E]
            ids, weights = self.route(logits, self.bias(layer))
        n_exp, k = self.cfg.n_routed_experts, self.top_k
        flat = ids.reshape(-1)  # [N·k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=n_exp)
        self.loads[layer] = counts
        xs = xf[order // k]  # [N·k, D], grouped by expert
        gate_up = self.w(f"{p}.experts.gate_up").to(xs.dtype)
        down = self.w(f"{p}.experts.down").to(xs.dtype)
        i = self.cfg.moe_intermediate_size
        outs = []
        for e, chunk in enumerate(xs.split(counts.tolist())):
            gu = chunk @ gate_up[e].t()  # [n, 2I]
            outs.append((F.silu(gu[:, :i]) * gu[:, i:]) @ down[e].t())  # [n, D]
        ys = torch.cat(outs)[order.argsort()].view(-1, k, shape[-1])  # [N, k, D], slot order
        routed = (ys * weights.unsqueeze(-1).to(ys.dtype)).sum(1)
        return (routed + self.mlp(f"{p}.shared_experts", xf)).view(shape)

    def decoder_layer(self, layer: int, h: torch.Tensor, cos, sin) -> torch.Tensor:
        p = f"model.layers.{layer}"
        h = h + self.attention(layer, self.norm(f"{p}.input_layernorm", h), cos, sin)
        x = self.norm(f"{p}.post_attention_layernorm", h)
        if self.cfg.is_moe_layer(layer):
            return h + self.moe(layer, x)
        return h + self.mlp(f"{p}.mlp", x)

    def forward(
        self, tokens: torch.Tensor, mtp: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, V] for ``tokens`` [B, T]; with ``mtp``, also the MTP layer's [B, T-1, V]
        (position i predicts token i+2 from h_i and token i+1)."""
        c = self.cfg
        t = tokens.shape[1]
        cos, sin = (z.to(tokens.device) for z in cos_sin(self.rope, torch.arange(t)))
        embed = self.w("model.embed_tokens.weight")
        h = embed[tokens]
        for layer in range(c.num_hidden_layers):
            h = self.decoder_layer(layer, h, cos, sin)
        hn = self.norm("model.norm", h)
        logits = F.linear(hn, self.w("lm_head.weight"))
        if not mtp or not c.num_nextn_predict_layers:
            return logits, None
        layer = c.num_hidden_layers  # one MTP module (DeepSeek-V3 ships one)
        p = f"model.layers.{layer}"
        e = self.norm(f"{p}.enorm", embed[tokens[:, 1:]])
        hp = self.norm(f"{p}.hnorm", hn[:, :-1])
        x = self.linear(f"{p}.eh_proj", torch.cat([e, hp], dim=-1))
        x = self.decoder_layer(layer, x, cos[: t - 1], sin[: t - 1])
        x = self.norm(f"{p}.shared_head.norm", x)
        return logits, F.linear(x, self.w("lm_head.weight"))

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: push each expert's bias toward mean load."""
        for layer, counts in self.loads.items():
            load = counts.float()
            self.bias(layer).add_(rate * torch.sign(load.mean() - load))
        self.loads.clear()
