"""Train a small DeepSeek-V3-architecture model on CPython's docs; ship it as DeepSeek ships V3.

The random-weight ``tiny-deepseek-v3`` beside this script produces noise; this script produces a
*trained* checkpoint of the same architecture family, whose activations (outliers, attention
sinks, skewed expert loads) look like a real model's — what quantization recipes need to be
measured on. Output (``--out``, default ``examples/tiny-deepseek-v3-trained/``): block-FP8
(E4M3 + F32 ``weight_scale_inv``, ``Fp8Block().quantize``) linears, BF16 norms / embeddings /
router / MTP ``eh_proj``, F32 ``e_score_correction_bias``, the MTP layer with its extras (embed
and head as copies), ``num_hidden_layers + 2`` shards with one scale in a later shard than its
weight and one weight in a later shard than its scale, the index, ``config.json`` with every key
of the real one (``make_tiny.CONFIG``), tokenizer files, ``generation_config.json``, and a
README with the run's facts (corpus sha256, steps, losses, held-out perplexities, checks).

Model (``FULL``): hidden 384, vocab 4096 (byte-level BPE retrained on the training text, as
make_tiny.py does, DeepSeek's special tokens at 0/1/2), 4 layers (layer 0 dense, intermediate
1024; layers 1-3 MoE: 16 routed experts of intermediate 128 + 1 shared, top-2 of 4 groups /
2 kept, sigmoid, ``noaux_tc``, scale 2.5), MLA with 8 heads, q_lora 256, kv_lora 128,
qk_nope 64, qk_rope 32, v 64 (``kv_a_proj_with_mqa``: 160 rows, a partial 128-block), YaRN ×4
over 1024; one MTP layer (MoE). 14.6 M parameters in the main model (8.4 M active per token),
3.5 M more in the MTP layer; 27.9 MB of tensors (FP8 linears 14.6 MB, BF16 13.2 MB of which
12.6 MB are the embedding, head and their MTP copies), 28.2 MB with the tokenizer. Hidden 384
rather than 512 keeps the checkpoint under 30 MB: at 512 the four [4096, H] BF16 matrices alone
take 16.8 MB.

Training: a batched module (``Model``) equivalent to ``hetquant.runtime.model`` — tokens sorted
by expert, one matmul pair per expert — trained with AdamW (fp32 master weights, bf16 autocast
on CUDA), next-token loss + 0.3 × the MTP loss (DeepSeek-V3's λ for most of its pre-training),
and DeepSeek's auxiliary-loss-free balancing: after every step each MoE layer's
``e_score_correction_bias += γ · sign(mean_load − load)`` (γ = 1e-3, MTP layer included). The
MTP layer follows vLLM / SGLang's DeepSeek MTP: ``eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])``
with ``h_i`` the main model's *final-normed* hidden state, one decoder layer, ``shared_head``
(norm + head) on its output, predicting ``t_{i+2}``; its embedding and head are the main
model's. Samples are ``[BOS] + 512`` tokens of the text, non-overlapping windows at a random
offset per epoch, shuffled (``--seed``).

After training, mandatory check: ``DeepseekV3Reference(cfg, DenseWeights(trained fp32 state))``
from ``hetquant.runtime.model`` gives the training module's logits within float32
summation-order tolerance (the run stops before writing otherwise). Then the checkpoint is
written, read back through ``hetquant.convert.source.SourceCheckpoint``, dequantized with
DeepSeek's formula, and the held-out perplexity of (a) the float model (training module, fp32)
and (b) the FP8 checkpoint through the runtime reference are printed and written.

Length: ``--steps N`` is exact and deterministic given ``--seed`` and the device. Without it the
run ends after ``--minutes`` of training (default 8) or ``--max-epochs`` passes over the text
(default 10: 2.7 M training tokens is little for 18 M parameters, more passes overfit — the
README's held-out curve shows it), whichever comes first. The step count is fixed once, from the
timing of steps 5-24, inside the warm-up whose schedule does not depend on it, so the run equals
``--steps`` of that count, which the README records. On CUDA,
``torch.use_deterministic_algorithms(True, warn_only=True)`` and no TF32; kernels without a
deterministic variant (SDPA's backward) warn and may differ in the last bits between runs.

The training text depends on the machine (Python version for ``pydoc_data``, Debian's
``python3-doc`` for the HTML manual; see corpus.py). For a GPU box without python3-doc, export
the corpus here and pass it along::

    python examples/tiny-deepseek-v3/corpus.py --export corpus-export   # here, with python3-doc
    python examples/tiny-deepseek-v3/train.py --device cuda --corpus corpus-export
    python examples/tiny-deepseek-v3/train.py --smoke --out /tmp/smoke   # 20 CPU steps, tiny dims
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.util
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from hetquant.convert.source import SourceCheckpoint
from hetquant.formats.families import ModelConfig, expected_tensors
from hetquant.formats.fp8_block import Fp8Block
from hetquant.runtime.model import DeepseekV3Reference, DenseWeights, rms_norm
from hetquant.runtime.rope import RopeSpec, cos_sin

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "tiny-deepseek-v3-trained"
FP8 = Fp8Block()


def _sibling(name: str) -> ModuleType:
    """Import ``name``.py from this folder without writing ``__pycache__`` beside it."""
    key = f"_tiny_deepseek_v3_{name}"  # registered (dataclasses need it) under a private name
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        sys.modules[key] = module
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = saved
    return module


make_tiny = _sibling("make_tiny")  # the real config keys, tokenizer files, shard names
corpus_mod = _sibling("corpus")

# ----------------------------------------------------------------------------------------------
# configuration

FULL = {  # dims of the committed trained model (see module docstring)
    "hidden_size": 384,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "num_nextn_predict_layers": 1,
}
SMOKE = {  # a few seconds on a laptop CPU
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "num_nextn_predict_layers": 1,
}


@dataclass
class Hyper:
    vocab: int = 4096
    seq_len: int = 512
    batch: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3  # DeepSeek-V3's λ for the first 10T tokens
    bias_rate: float = 1e-3  # DeepSeek-V3's γ for the first 14.3T tokens
    init_std: float = 0.02  # config initializer_range
    max_epochs: float = 10.0  # the text is small: more passes overfit (see the README's curve)
    eval_every: int = 100


SMOKE_HYPER = Hyper(
    vocab=640, seq_len=64, batch=8, lr=3e-3, warmup=3, max_epochs=1e9, eval_every=10
)


def model_config(dims: dict, vocab: int) -> dict:
    """The full HF config.json (every key of DeepSeek-V3's) for ``dims``."""
    return {**make_tiny.CONFIG, **dims, "vocab_size": vocab}


# ----------------------------------------------------------------------------------------------
# the training module


def _noise(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Zero-mean unit-variance float32 noise for parameter ``name``: integer draws only, so the
    initialization is identical on every platform (as make_tiny.py does)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    draws = torch.randint(0, 1 << 24, (4, *shape), generator=gen, dtype=torch.int64)
    return ((draws.sum(0).to(torch.float64) / (1 << 24) - 2.0) * math.sqrt(3.0)).float()


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

    def __init__(self, config: dict, seed: int = 0, init_std: float = 0.02) -> None:
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
        n_layers = c.total_layers
        out_std = init_std / math.sqrt(2 * n_layers)  # residual-branch outputs
        for name, shape, kind in self.param_specs():
            if kind == "norm":
                t = torch.ones(shape)
            else:
                std = out_std if kind == "out" else init_std
                t = _noise(seed, name, shape) * std
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


# ----------------------------------------------------------------------------------------------
# data


def train_tokenizer(text: str, vocab_size: int) -> str:
    """make_tiny.py's byte-level BPE (DeepSeek's special tokens at 0, 1, 2), trained on ``text``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    mt = make_tiny
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(mt.CHAT_TOKENS),
        min_frequency=2,
        special_tokens=[mt.BOS, mt.EOS, mt.PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_paragraphs(text), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in mt.CHAT_TOKENS])
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{mt.BOS} $A",
                pair=f"{mt.BOS} $A {mt.BOS} $B:1",
                special_tokens=[(mt.BOS, 0)],
            ),
        ]
    )
    if tok.token_to_id(mt.BOS) != 0 or tok.token_to_id(mt.EOS) != 1:
        raise RuntimeError("tokenizer: BOS/EOS did not get ids 0/1")
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer: vocab {tok.get_vocab_size()} != {vocab_size}")
    return tok.to_str(pretty=True) + "\n"


def _paragraphs(text: str) -> list[str]:
    """``text`` cut after each blank line (pieces rejoin to ``text``): the encoding unit."""
    parts = text.split("\n\n")
    return [p + "\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def encode(tokenizer_json: str, text: str) -> torch.Tensor:
    """The token stream of ``text`` (no special tokens), int64 [n]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    ids: list[int] = []
    for enc in tok.encode_batch(_paragraphs(text), add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, seq_len: int, offset: int = 0) -> torch.Tensor:
    """Non-overlapping samples ``[BOS] + stream[o : o + seq_len]``, int64 [n, seq_len + 1]."""
    n = (stream.numel() - offset) // seq_len
    body = stream[offset : offset + n * seq_len].view(n, seq_len)
    return torch.cat([torch.zeros(n, 1, dtype=torch.int64), body], dim=1)  # BOS = 0


class Batches:
    """Epochs of shuffled windows (a fresh random offset per epoch), deterministic in ``seed``."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> None:
        self.stream, self.seq_len, self.batch, self.seed = stream, seq_len, batch, seed
        self.epoch, self.queue = -1, torch.empty(0, seq_len + 1, dtype=torch.int64)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, (self.stream.numel() - self.seq_len) // self.seq_len // self.batch)

    def next(self) -> torch.Tensor:
        if self.queue.shape[0] < self.batch:
            self.epoch += 1
            gen = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
            offset = int(torch.randint(0, self.seq_len, (1,), generator=gen))
            w = windows(self.stream, self.seq_len, offset)
            self.queue = w[torch.randperm(w.shape[0], generator=gen)]
        out, self.queue = self.queue[: self.batch], self.queue[self.batch :]
        return out


# ----------------------------------------------------------------------------------------------
# evaluation


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def module_nll(
    model: Model, samples: torch.Tensor, device: torch.device, bf16: bool = False, batch: int = 16
) -> float:
    """Mean next-token NLL of the training module over ``samples`` [n, T+1]."""
    total, count = 0.0, 0
    for i in range(0, samples.shape[0], batch):
        s = samples[i : i + batch].to(device)
        with autocast(device) if bf16 else contextlib.nullcontext():
            logits, _ = model(s[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), s[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + s[:, 1:].numel()
    model.loads.clear()
    return total / count


@torch.no_grad()
def runtime_logits(cfg: ModelConfig, state: dict, samples: torch.Tensor) -> list[torch.Tensor]:
    """``hetquant.runtime.model.DeepseekV3Reference`` logits [T, V] for each sample's input."""
    ref = DeepseekV3Reference(cfg, DenseWeights(state, cfg.family))
    return [ref(s[:-1]) for s in samples]


def runtime_nll(cfg: ModelConfig, state: dict, samples: torch.Tensor) -> float:
    total, count = 0.0, 0
    ref = DeepseekV3Reference(cfg, DenseWeights(state, cfg.family))
    for s in samples:
        logits = ref(s[:-1])
        total += float(F.cross_entropy(logits, s[1:], reduction="sum"))
        count += s.numel() - 1
    return total / count


def summation_tolerance(cfg: ModelConfig, seq_len: int) -> float:
    """Relative float32 logit tolerance between two forwards that differ in summation order only:
    ``4 · K_max · 2^-24`` with K_max the longest reduction (tests/runtime/test_model.py's rule)."""
    c = cfg
    k_max = max(
        c.hidden_size,
        c.intermediate_size,
        c.moe_intermediate_size,
        c.num_attention_heads * c.v_head_dim,
        c.qk_head_dim,
        c.kv_lora_rank,
        c.q_lora_rank or 0,
        seq_len,  # attention sums over the positions
    )
    return 4 * k_max * 2.0**-24


@torch.no_grad()
def verify_runtime(model: Model, samples: torch.Tensor) -> dict:
    """The mandatory check: runtime/model.py on the trained float32 weights = this module."""
    state = model.hf_state()
    cpu = Model(model.raw)
    cpu.load_hf_state(state)
    ours = [cpu(s[None, :-1])[0][0] for s in samples]
    cpu.loads.clear()
    theirs = runtime_logits(cpu.cfg, state, samples)
    ours_t, theirs_t = torch.stack(ours), torch.stack(theirs)
    diff = (ours_t - theirs_t).abs()
    tol = summation_tolerance(cpu.cfg, samples.shape[1]) * float(theirs_t.abs().max())
    bad = diff.amax(-1) > tol  # positions off by more than the tolerance
    frac = float(bad.float().mean())
    return {
        "positions": int(bad.numel()),
        "max_abs_diff": float(diff.max()),
        "tolerance": tol,
        "positions_over_tolerance": int(bad.sum()),
        # a router near-tie may flip one expert choice between the two summation orders
        "ok": frac <= 1e-3,
    }


def read_checkpoint(out: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The written checkpoint through hetquant's reader, dequantized (DeepSeek's formula) to f32."""
    src = SourceCheckpoint.open(out)
    block = Fp8Block(src.config.weight_block_size[0])
    state = {}
    for name, t in src.tensors.items():
        if t.is_fp8:
            state[name] = block.dequantize_bf16(src.weight(name), src.scale(name)).float()
        else:
            state[name] = src.weight(name).float()
    return src.config, state


# ----------------------------------------------------------------------------------------------
# writing


def shipped_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek's dtypes, from hetquant's role table: FP8 + F32 scale for every linear but the
    MTP ``eh_proj`` (BF16 in DeepSeek's checkpoint), F32 router bias, BF16 for the rest."""
    roles = expected_tensors(cfg)
    if set(state) != set(roles):
        extra, missing = sorted(set(state) - set(roles)), sorted(set(roles) - set(state))
        raise SystemExit(f"state does not match the role table: extra {extra}, missing {missing}")
    out = {}
    for name, role in roles.items():
        t = state[name]
        if tuple(t.shape) != role.shape:
            raise SystemExit(f"{name}: shape {tuple(t.shape)}, role table says {role.shape}")
        if role.role.kind == "linear" and role.role.name != "mtp_eh_proj":
            q = FP8.quantize(t)
            out[name], out[f"{name}_scale_inv"] = q["weight"], q["weight_scale_inv"]
        elif role.role.kind == "bias":
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def shard_of(name: str, cfg: ModelConfig) -> int:
    """1-based shard: embed + layer 0 → 1, layer L → L + 1, MTP decoder + norm + head → n + 1,
    MTP extras → n + 2 (n = num_hidden_layers). Two pairs split on purpose: layer 0's
    ``kv_a_proj_with_mqa`` scale lives in shard 2 (after its weight), the last main layer's last
    expert ``down_proj.weight`` in shard n + 1 (after its scale)."""
    n = cfg.num_hidden_layers
    if name == "model.embed_tokens.weight":
        return 1
    if name in ("model.norm.weight", "lm_head.weight"):
        return n + 1
    layer = int(name.split(".")[2])
    sub = name.split(".", 3)[3]
    if layer >= n:
        return n + 2 if sub.split(".")[0] in make_tiny.MTP_EXTRAS else n + 1
    if layer == 0 and sub == "self_attn.kv_a_proj_with_mqa.weight_scale_inv":
        return 2
    if layer == n - 1 and sub == f"mlp.experts.{cfg.n_routed_experts - 1}.down_proj.weight":
        return n + 1
    return layer + 1


def write_checkpoint(
    out: Path, config: dict, state: dict[str, torch.Tensor], tokenizer_json: str
) -> dict[str, int]:
    cfg = ModelConfig.from_dict(config)
    if cfg.num_hidden_layers < 2 or not cfg.is_moe_layer(cfg.num_hidden_layers - 1):
        raise SystemExit("write_checkpoint: needs >= 2 layers, the last one MoE")
    out.mkdir(parents=True, exist_ok=True)
    tensors = shipped_tensors(state, cfg)
    n_shards = cfg.num_hidden_layers + 2
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    for name, t in tensors.items():
        shards[shard_of(name, cfg) - 1][name] = t
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = make_tiny.shard_name(i, n_shards)
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    make_tiny._write_json(out / "model.safetensors.index.json", index)
    make_tiny._write_json(out / "config.json", config)
    make_tiny._write_json(out / "generation_config.json", make_tiny.GENERATION_CONFIG)
    tok_cfg = {**make_tiny.TOKENIZER_CONFIG, "model_max_length": config["max_position_embeddings"]}
    make_tiny._write_json(out / "tokenizer_config.json", tok_cfg)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    files = [make_tiny.shard_name(i, n_shards) for i in range(1, n_shards + 1)]
    files += ["model.safetensors.index.json", "config.json", "generation_config.json"]
    files += ["tokenizer.json", "tokenizer_config.json"]
    return {f: (out / f).stat().st_size for f in files}


def param_counts(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, int]:
    main = {n: t for n, t in state.items() if not _is_mtp(n, cfg)}
    mtp_own = {
        n: t
        for n, t in state.items()
        if _is_mtp(n, cfg) and not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))
    }
    routed = sum(t.numel() for n, t in main.items() if ".mlp.experts." in n)
    per_expert = routed // max(
        1,
        cfg.n_routed_experts
        * len([i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]),
    )
    k = int(cfg.raw["num_experts_per_tok"])
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    total_main = sum(t.numel() for t in main.values())
    return {
        "main": total_main,
        "main_active_per_token": total_main - routed + n_moe * k * per_expert,
        "mtp_own": sum(t.numel() for t in mtp_own.values()),
        "stored_incl_mtp_copies": sum(t.numel() for t in state.values()),
    }


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_hidden_layers


# ----------------------------------------------------------------------------------------------
# training


@dataclass
class Result:
    out: Path
    model: Model  # trained, on the training device
    config: dict
    losses: list[float] = field(default_factory=list)
    mtp_losses: list[float] = field(default_factory=list)
    heldout: torch.Tensor | None = None  # evaluation samples [n, T+1]
    report: dict = field(default_factory=dict)


def lr_at(step: int, total: int, h: Hyper) -> float:
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = min(1.0, (step - h.warmup) / max(1, total - h.warmup))
    return h.lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Model, h: Hyper, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for k, p in model.p.items() if p.ndim >= 2]
    no_decay = [p for k, p in model.p.items() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": h.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=h.lr, betas=h.betas, eps=1e-8, fused=device.type == "cuda")


def log(msg: str) -> None:
    print(msg, flush=True)


def run(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: list[str] | None) -> Result:
    smoke = args.smoke
    h = copy.deepcopy(SMOKE_HYPER if smoke else Hyper())
    for k in ("lr", "batch", "seq_len", "warmup", "max_epochs", "eval_every"):
        if getattr(args, k) is not None:
            setattr(h, k, getattr(args, k))
    dims = SMOKE if smoke else FULL
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t_start = time.time()

    # corpus and tokenizer
    texts = corpus_mod.load(args.corpus, use_html=not (args.no_html or smoke))
    log(f"corpus: train {len(texts.train):,} chars, held-out {len(texts.heldout):,} chars")
    if not smoke and "python3-doc" not in texts.describe["sources"]:
        log(
            "WARNING: training on pydoc_data.topics alone (no python3-doc here): a few hundred KB; "
            "export the corpus where python3-doc is installed and pass --corpus"
        )
    committed, same_heldout = HERE / "heldout.txt", None
    if not smoke and committed.is_file():
        same_heldout = committed.read_text(encoding="utf-8") == texts.heldout
        log(f"held-out text {'=' if same_heldout else '!='} {committed}")
    tokenizer_json = train_tokenizer(texts.train, h.vocab)
    train_stream = encode(tokenizer_json, texts.train)
    held_stream = encode(tokenizer_json, texts.heldout)
    heldout = windows(held_stream, h.seq_len)
    if args.eval_windows:
        heldout = heldout[: args.eval_windows]
    log(
        f"tokens: train {train_stream.numel():,}, held-out {held_stream.numel():,} "
        f"({heldout.shape[0]} windows of {h.seq_len}) [{time.time() - t_start:.0f}s]"
    )

    config = model_config(dims, h.vocab)
    torch.manual_seed(args.seed)
    model = Model(config, seed=args.seed, init_std=h.init_std).to(device)
    opt = make_optimizer(model, h, device)
    batches = Batches(train_stream, h.seq_len, h.batch, args.seed)
    epoch_steps = batches.steps_per_epoch
    cap = max(1, int(h.max_epochs * epoch_steps))
    total = args.steps if args.steps else cap
    probe = (5, 25) if not args.steps else None
    budget = args.minutes * 60
    if args.compile:
        model.attention = torch.compile(model.attention)  # type: ignore[method-assign]
    log(f"training: {epoch_steps} steps/epoch, cap {cap} steps, device {device}")

    result = Result(out=args.out, model=model, config=config, heldout=heldout)
    evals: list[tuple[int, float]] = []
    t_train = time.time()
    t_probe = None
    step = 0
    while step < total:
        if probe and step == probe[0]:
            _sync(device)
            t_probe = time.time()
        if probe and step == probe[1] and t_probe is not None:
            _sync(device)
            per_step = (time.time() - t_probe) / (probe[1] - probe[0])
            remaining = budget - (time.time() - t_train)
            fit = probe[1] + int(0.95 * remaining / per_step)
            total = max(probe[1], min(cap, fit))
            log(f"probe: {per_step * 1000:.1f} ms/step -> {total} steps")
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, h)
        batch = batches.next().to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast(device):
            logits, mtp_logits = model(inputs, mtp=bool(config["num_nextn_predict_layers"]))
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        total_loss = loss
        if mtp_logits is not None:
            mtp_loss = F.cross_entropy(mtp_logits.float().flatten(0, 1), targets[:, 1:].flatten())
            total_loss = loss + h.mtp_weight * mtp_loss
            result.mtp_losses.append(mtp_loss.item())
        opt.zero_grad(set_to_none=True)
        total_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        opt.step()
        model.update_bias(h.bias_rate)
        result.losses.append(loss.item())
        step += 1
        if step % h.eval_every == 0 or step == total:
            ev = module_nll(model, heldout, device, bf16=device.type == "cuda")
            evals.append((step, ev))
            log(
                f"step {step}/{total} epoch {batches.epoch} lr {lr_at(step - 1, total, h):.2e} "
                f"loss {result.losses[-1]:.3f} mtp {result.mtp_losses[-1] if result.mtp_losses else 0:.3f} "
                f"held-out {ev:.3f} (ppl {math.exp(ev):.1f}) [{time.time() - t_train:.0f}s]"
            )
    _sync(device)
    train_s = time.time() - t_train

    # checks, checkpoint, evaluation
    model.eval()
    verify = verify_runtime(model, heldout[: args.verify_windows])
    log(f"runtime check (float weights): {verify}")
    if not verify["ok"]:
        raise SystemExit("runtime/model.py disagrees with the training module; not writing")
    state = model.hf_state()
    sizes = write_checkpoint(args.out, config, state, tokenizer_json)
    cfg_read, deq = read_checkpoint(args.out)
    float_nll = module_nll(model, heldout, device)
    fp8_nll = runtime_nll(cfg_read, deq, heldout)
    report = {
        "dims": dims,
        "hyper": {k: getattr(h, k) for k in Hyper.__dataclass_fields__},
        "seed": args.seed,
        "device": str(device)
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": step,
        "epochs": round(step / epoch_steps, 2),
        "train_seconds": round(train_s, 1),
        "tokens_seen": step * h.batch * h.seq_len,
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens_evaluated": int(heldout[:, 1:].numel()),
        "heldout_is_committed_heldout_txt": same_heldout,
        "first_loss": result.losses[0],
        "final_loss_mean_last_10": sum(result.losses[-10:]) / len(result.losses[-10:]),
        "final_mtp_loss_mean_last_10": (
            sum(result.mtp_losses[-10:]) / len(result.mtp_losses[-10:])
            if result.mtp_losses
            else None
        ),
        "evals": evals,
        "heldout_nll_float": float_nll,
        "heldout_ppl_float": math.exp(float_nll),
        "heldout_nll_fp8_runtime": fp8_nll,
        "heldout_ppl_fp8_runtime": math.exp(fp8_nll),
        "runtime_check": verify,
        "expert_bias_absmax": {
            layer: float(model.bias(layer).abs().max()) for layer in model.moe_layers
        },
        "params": param_counts(state, ModelConfig.from_dict(config)),
        "files": sizes,
        "checkpoint_bytes": sum(sizes.values()),
        "corpus": texts.describe,
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        "command": "python examples/tiny-deepseek-v3/train.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    result.report = report
    (args.out / "README.md").write_text(readme(report), encoding="utf-8")
    log(
        f"held-out ppl: float {report['heldout_ppl_float']:.3f}, "
        f"FP8 checkpoint via runtime {report['heldout_ppl_fp8_runtime']:.3f}; "
        f"{report['checkpoint_bytes']:,} bytes in {args.out} [{time.time() - t_start:.0f}s total]"
    )
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def readme(r: dict) -> str:
    d, p, c, h = r["dims"], r["params"], r["corpus"], r["hyper"]
    sources = ", ".join(
        f"`{k}` ({v['documents']} docs, sha256 {v['sha256'][:16]}…)"
        for k, v in c["sources"].items()
    )
    held = {
        True: "the same text as",
        False: "NOT the same text as (other corpus sources)",
        None: "not compared with",
    }
    mtp_loss = r["final_mtp_loss_mean_last_10"]
    n_layers, n_shards = d["num_hidden_layers"], len(r["files"]) - 5
    lines = [
        "# tiny-deepseek-v3-trained",
        "",
        "A small model with DeepSeek-V3's architecture, **trained** on CPython's documentation,",
        "shipped file for file as DeepSeek ships V3 / R1: block-FP8 (E4M3, 128×128, F32",
        "`weight_scale_inv`) linears, BF16 norms / embeddings / router / MTP `eh_proj`, F32",
        f"`e_score_correction_bias`, the MTP layer with its extras, {n_shards} shards with",
        "weight/scale pairs split across shards both ways, the index, every key of the real",
        "`config.json`. Written, this file included, by `examples/tiny-deepseek-v3/train.py`.",
        "",
        "| | |",
        "|---|---|",
        f"| hidden / vocab | {d['hidden_size']} / {h['vocab']} (byte-level BPE trained on the "
        "training text, DeepSeek's special tokens) |",
        f"| layers | {n_layers}: {d['first_k_dense_replace']} dense (intermediate "
        f"{d['intermediate_size']}), the rest MoE; MTP layer `model.layers.{n_layers}` |",
        f"| MLA | {d['num_attention_heads']} heads, q_lora {d['q_lora_rank']}, kv_lora "
        f"{d['kv_lora_rank']}, qk_nope {d['qk_nope_head_dim']}, qk_rope "
        f"{d['qk_rope_head_dim']}, v {d['v_head_dim']} |",
        f"| MoE | {d['n_routed_experts']} routed experts (intermediate "
        f"{d['moe_intermediate_size']}), {d['n_shared_experts']} shared, "
        f"top-{d['num_experts_per_tok']}, {d['n_group']} groups / top-{d['topk_group']}, "
        "`noaux_tc`, sigmoid, scale 2.5 |",
        f"| parameters | {p['main']:,} main ({p['main_active_per_token']:,} active per token), "
        f"{p['mtp_own']:,} MTP-only; {p['stored_incl_mtp_copies']:,} stored (MTP copies of "
        "embed / head included) |",
        f"| checkpoint | {r['checkpoint_bytes']:,} bytes |",
        "",
        "## Held-out perplexity",
        "",
        "| model | NLL | perplexity |",
        "|---|---|---|",
        f"| float32 weights, training module | {r['heldout_nll_float']:.4f} | "
        f"{r['heldout_ppl_float']:.3f} |",
        "| this FP8 checkpoint, dequantized, `hetquant.runtime.model.DeepseekV3Reference` | "
        f"{r['heldout_nll_fp8_runtime']:.4f} | {r['heldout_ppl_fp8_runtime']:.3f} |",
        "",
        f"{r['heldout_tokens_evaluated']:,} held-out tokens in windows of {h['seq_len']} "
        "(BOS + text) from documents never trained on; "
        f"{held[r['heldout_is_committed_heldout_txt']]} "
        "`examples/tiny-deepseek-v3/heldout.txt` (`corpus.py --write-heldout`).",
        "Runtime check on the float weights (mandatory; the run stops otherwise): "
        f"{r['runtime_check']}.",
        "",
        "## Training",
        "",
        f"- Text: {sources}; training text {c['train']['bytes']:,} bytes, sha256 "
        f"`{c['train']['sha256']}`; held-out {c['heldout']['bytes']:,} bytes, sha256 "
        f"`{c['heldout']['sha256']}`; split: {c['split']}.",
        f"- {r['steps']} steps ({r['epochs']} epochs of {r['train_tokens']:,} tokens) of "
        f"{h['batch']} × {h['seq_len']} tokens in {r['train_seconds']} s on {r['device']}, "
        f"torch {r['torch']}, Python {r['python']}, seed {r['seed']}.",
        f"- AdamW (β {h['betas']}, weight decay {h['weight_decay']} on matrices), peak lr "
        f"{h['lr']}, {h['warmup']} warm-up steps, cosine to {h['min_lr_ratio']}×, grad clip "
        f"{h['grad_clip']}; fp32 master weights, bf16 autocast on CUDA.",
        f"- Loss: next token + {h['mtp_weight']} × MTP (token i+2 from the final-normed h_i and "
        "embed(t_(i+1)), vLLM's DeepSeek MTP convention).",
        f"- Aux-loss-free balancing: `e_score_correction_bias += {h['bias_rate']} · "
        "sign(mean_load − load)` after each step; max |bias| per layer at the end: "
        f"{r['expert_bias_absmax']}.",
        f"- Loss {r['first_loss']:.3f} at step 1, {r['final_loss_mean_last_10']:.3f} over the "
        f"last 10 steps (MTP {mtp_loss if mtp_loss is None else round(mtp_loss, 3)}).",
        f"- Tokenizer sha256 `{r['tokenizer_sha256']}`.",
        f"- Reproduce: `{r['command']}` with `--steps {r['steps']}` (exact on the same device; "
        "see train.py on GPU determinism).",
        "",
        "| step | held-out NLL (bf16 on CUDA) | perplexity |",
        "|---|---|---|",
        *(f"| {step} | {v:.3f} | {math.exp(v):.2f} |" for step, v in r["evals"]),
        "",
        "## Files",
        "",
        "| file | bytes |",
        "|---|---|",
        *(f"| `{f}` | {n:,} |" for f, n in r["files"].items()),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="default: cuda when available (--smoke: cpu)",
    )
    ap.add_argument("--minutes", type=float, default=8.0, help="training-loop budget")
    ap.add_argument("--steps", type=int, help="exact step count (overrides --minutes)")
    ap.add_argument("--max-epochs", type=float, help="cap on passes over the training text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, help="a corpus.py --export folder (else built here)")
    ap.add_argument("--no-html", action="store_true", help="pydoc_data.topics only")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--eval-windows", type=int, help="held-out windows to evaluate (default all)")
    ap.add_argument("--verify-windows", type=int, default=4)
    ap.add_argument("--compile", action="store_true", help="torch.compile the attention")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; smoke: 1)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, CPU, 20 steps")
    args = ap.parse_args(argv)
    if args.smoke:
        if "--device" not in (argv if argv is not None else sys.argv[1:]):
            args.device = "cpu"
        args.steps = args.steps or 20
        args.eval_windows = args.eval_windows or 8
        args.verify_windows = min(args.verify_windows, 2)
        args.threads = args.threads or 1
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    return args


def main() -> None:
    run()


if __name__ == "__main__":
    main()
