"""``train.py``'s checks and scores: the training module against ``hetquant.runtime.forward.model``,
held-out NLL of either, and the written checkpoint read back through hetquant's reader."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.convert import SourceCheckpoint
from hetquant.formats.families import ModelConfig
from hetquant.runtime.forward.model import DeepseekV3Reference, DenseWeights

__all__ = [
    "autocast",
    "module_nll",
    "read_checkpoint",
    "runtime_logits",
    "runtime_nll",
    "summation_tolerance",
    "verify_runtime",
]


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def module_nll(
    model: Any, samples: torch.Tensor, device: torch.device, bf16: bool = False, batch: int = 16
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
    """``hetquant.runtime.forward.model.DeepseekV3Reference`` logits [T, V] for each sample's input."""
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
    ``4 · K_max · 2^-24`` with K_max the longest reduction (tests/runtime/forward/test_model.py's rule)."""
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
def verify_runtime(model: Any, samples: torch.Tensor) -> dict:
    """The mandatory check: runtime/forward/model.py on the trained float32 weights = this module."""
    state = model.hf_state()
    cpu = type(model)(model.raw)
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
    state = {name: src.dequantized(name).float() for name in src.tensors}
    return src.config, state
