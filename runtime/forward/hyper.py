"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream.

The residual is ``n = hc_mult`` parallel streams, hidden states ``h`` [T, n, D]. Around each
block (attention, MoE) one hyper-connection with parameters ``fn`` [(2+n)·n, n·D],
``base`` [(2+n)·n], ``scale`` [3] (transformers 5.24 ``modeling_deepseek_v4.py:885-996``,
``DeepseekV4HyperConnection``; DeepSeek's ``hc_{attn,ffn}_{fn,base,scale}``)::

    m            = unweighted_rmsnorm(flatten(h)) · fnᵀ               [T, (2+n)·n]   (float32)
    pre, post, c = split(m, [n, n, n·n])
    pre  = sigmoid(pre · scale[0] + base_pre) + hc_eps                 [T, n]
    post = 2 · sigmoid(post · scale[1] + base_post)                    [T, n]
    comb = softmax(c · scale[2] + base_comb, over the last axis) + hc_eps   [T, n, n]
    comb = comb / (column sums + hc_eps); then (hc_sinkhorn_iters - 1) times:
           rows / (row sums + hc_eps), columns / (column sums + hc_eps)     (Sinkhorn-Knopp)
    x    = Σ_j pre_j · h_j                                             [T, D]  the block's input
    h'   = post ⊗ block(x) + combᵀ · h                                 [T, n, D]

(``h'[k] = post[k]·y + Σ_j comb[j, k]·h[j]``, ``DeepseekV4DecoderLayer.forward``, 1175-1200.) Before the
final norm the hyper-head (``hc_head_fn`` [n, n·D], ``hc_head_base`` [n], ``hc_head_scale`` [1],
``DeepseekV4HyperHead``, 999-1015) collapses the streams with
``pre = sigmoid(unweighted_rmsnorm(flatten(h)) · fnᵀ · scale + base) + hc_eps``. The unweighted
RMSNorm uses ``rms_norm_eps``. The mixing weights are computed in float32 (float64 for float64
activations: ``precision.py``); the streams stay in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .precision import work_dtype

__all__ = ["HyperSpec", "hc_expand", "hc_head", "hc_weights", "unweighted_rms_norm"]


@dataclass(frozen=True)
class HyperSpec:
    """``hc_mult`` streams, ``hc_sinkhorn_iters``, ``hc_eps`` and the RMSNorm's ``rms_norm_eps``."""

    streams: int
    sinkhorn_iters: int
    eps: float
    norm_eps: float


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim (transformers' ``DeepseekV4UnweightedRMSNorm``:
    the mean in float32 — float64 for float64 ``x`` —, the product in x's dtype)."""
    inv = torch.rsqrt(x.to(work_dtype(x.dtype)).square().mean(-1, keepdim=True) + eps)
    return x * inv.to(x.dtype)


def _mixes(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``unweighted_rmsnorm(flatten(h)) · fnᵀ`` in the work dtype, h [T, n, D] → [T, rows]."""
    wd = work_dtype(h.dtype)
    flat = unweighted_rms_norm(h.reshape(h.shape[0], -1).to(wd), eps)  # [T, n·D]
    return F.linear(flat, fn.to(wd))


def hc_weights(
    h: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    spec: HyperSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x`` [T, D] the block input in h's dtype, ``post`` [T, n], ``comb`` [T, n, n]) of the
    hyper-connection ``fn`` / ``base`` / ``scale`` on streams ``h`` [T, n, D] (module docstring)."""
    n = spec.streams
    mixes = _mixes(h, fn, spec.norm_eps)  # [T, (2+n)·n]
    wd = mixes.dtype
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.to(wd).split([n, n, n * n])
    pre_s, post_s, comb_s = scale.to(wd).unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + spec.eps  # [T, n]
    post = 2 * torch.sigmoid(post_w * post_s + post_b)  # [T, n]
    comb = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)  # [T, n, n]
    comb = torch.softmax(comb, dim=-1) + spec.eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + spec.eps)
    for _ in range(spec.sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + spec.eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + spec.eps)
    x = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, D]
    return x, post, comb


def hc_expand(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``post ⊗ y + combᵀ · h``: the streams after a block with output ``y`` [T, D], h [T, n, D]."""
    dt = h.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb.to(dt).transpose(-1, -2), h
    )  # [T, n, D]


def hc_head(
    h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, spec: HyperSpec
) -> torch.Tensor:
    """The hyper-head's collapse of streams ``h`` [T, n, D] → [T, D] (module docstring)."""
    mixes = _mixes(h, fn, spec.norm_eps)  # [T, n]
    wd = mixes.dtype
    pre = torch.sigmoid(mixes * scale.to(wd) + base.to(wd)) + spec.eps  # [T, n]
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
