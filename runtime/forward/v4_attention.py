"""DeepSeek-V4 attention: sliding window, compressed sparse (CSA) and heavily compressed (HCA),
for one sequence, as transformers 5.24 computes it (``modeling_deepseek_v4.py``; line numbers
below are that file's). Roles stand for their tensors (``formats/families/_deepseek_v4_roles.py``).

Per layer, on the normed block input ``x`` [T, D] (``DeepseekV4Attention.forward``, 812-883)::

    qr = rmsnorm(q_a(x), q_a_norm)                          [T, q_lora]  (also the indexer's input)
    q  = unweighted_rmsnorm_per_head(q_b(qr))               [T, H, hd]
    kv = rmsnorm(kv(x), kv_norm)                            [T, hd]      one head, key = value
    q, kv: RoPE on the trailing ``rd`` channels (interleaved pairs, ``rope.py``) at position t
    keys = kv of positions t-W < s <= t (W = sliding_window)  [+ compressed entries, below]
    o  = softmax_with_sink(q·keysᵀ · hd^-0.5) · keys        [T, H, hd]
    o  = RoPE(o) at position t with -sin (undoes the rotation the values carried)
    out = o_b( per group g: o_a_g(o[heads of g]) )          grouped output projection

``softmax_with_sink``: the head's ``sinks`` logit joins each row's softmax and its probability
is dropped (727-763). Sliding-window layers rope with the ``main`` rope (``rope_theta``);
compressed ones with the ``compress`` rope (``compress_rope_theta``, YaRN when configured,
without YaRN's magnitude factor: ``configuration_deepseek_v4.py:292-319``).

Compressor (rate m; HCA 373-455, CSA 600-713): ``kv = wkv(x)``, ``z = wgate(x) + ape`` over the
complete windows of m tokens; entry w = ``rmsnorm(Σ softmax(z)·kv, norm)`` roped at position
``w·m``. CSA's (and the indexer's) project to 2·d: entry w mixes the first d channels of window
w-1 with the last d of window w over 2m slots (window 0's missing half weighs 0). Query t sees
entry w iff ``w < (t+1) // m``. HCA attends to every visible entry; CSA to the ``index_topk`` the
indexer picks (458-597): its own compressor at ``index_head_dim``, queries ``wq_b(qr)`` roped at
t, score ``Σ_h (weights_proj(x)_h · n_I^-0.5) · relu(q_h·k_w) · d_I^-0.5``, future entries
excluded, top-k kept.

With ``spec.kv_cache`` (opt-in, ``kv_cache.py``) the keys — window and compressed entries
alike, values being the keys — pass through the engine's KV-cache storage before attention.

The grouped output runs ``o_a`` on every group's input and keeps each group's own block (a
``Weights.linear`` call, so quantized and TP-split ``o_a`` work unchanged; it multiplies that
projection's work by ``o_groups``, acceptable for a reference forward). Under TP a rank holds
H/tp query heads, their ``sinks``, and o_groups/tp groups; the KV head, compressors and indexer
are replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetquant.formats.families import ModelFamily

from .hyper import unweighted_rms_norm
from .model import Weights, rms_norm
from .precision import work_dtype
from .rope import RopeSpec, apply_rope, cos_sin

__all__ = ["AttentionSpec", "Positions", "attention", "compress", "rope_tail"]


@dataclass(frozen=True)
class AttentionSpec:
    """The attention's dimensions and constants, from config.json (``deepseek_v4.py``)."""

    heads: int
    head_dim: int
    o_groups: int
    rope_dim: int
    window: int
    rates: dict[str, int]  # scope (csa / hca) → compress rate
    index_heads: int
    index_dim: int
    index_topk: int
    eps: float
    main: RopeSpec
    compress: RopeSpec
    # keys [S, hd] → what the engine's KV cache gives back (``kv_cache.py``); None: kept as is
    kv_cache: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Positions:
    """One sequence's positions: cos / sin [T, rd/2] of both ropes, the window mask [T, T]
    (0 where visible, -inf elsewhere), the positions [T]."""

    pos: torch.Tensor
    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    window_mask: torch.Tensor

    @classmethod
    def build(cls, spec: AttentionSpec, t: int, dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
        pos = torch.arange(t)
        wd = work_dtype(dtype)
        main = tuple(c.to(device) for c in cos_sin(spec.main, pos, wd))
        comp = tuple(c.to(device) for c in cos_sin(spec.compress, pos, wd))
        d = pos[:, None] - pos[None, :]  # [T, T]: query − key
        visible = (d >= 0) & (d < spec.window)
        mask = torch.zeros(t, t).masked_fill(~visible, float("-inf")).to(device)
        return cls(pos.to(device), main, comp, mask)  # type: ignore[arg-type]


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the trailing ``2·cos.shape[-1]`` channels of ``x`` [T, ..., d] (the rest kept)."""
    rd = 2 * cos.shape[-1]
    return torch.cat([x[..., :-rd], apply_rope(x[..., -rd:], cos, sin)], dim=-1)


def compress(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    rate: int,
    rope: RopeSpec,
    eps: float,
) -> torch.Tensor:
    """Compressed entries [T // rate, d] of projections ``kv`` / ``gate`` [T, c·d] (c = 2:
    overlapping windows, 1: not) with ``ape`` [rate, c·d] and ``norm`` [d] (module docstring)."""
    d, n = norm.shape[0], kv.shape[0] // rate
    if n == 0:
        return kv.new_zeros(0, d)
    kv = kv[: n * rate].view(n, rate, -1)  # [n, m, c·d]
    gate = gate[: n * rate].view(n, rate, -1) + ape  # [n, m, c·d]
    if kv.shape[-1] == 2 * d:  # CSA: [window w-1's first half | window w's second half]
        kv2 = kv.new_zeros(n, 2 * rate, d)
        gate2 = gate.new_full((n, 2 * rate, d), float("-inf"))
        kv2[:, rate:], gate2[:, rate:] = kv[..., d:], gate[..., d:]
        kv2[1:, :rate], gate2[1:, :rate] = kv[:-1, :, :d], gate[:-1, :, :d]
        kv, gate = kv2, gate2  # [n, 2m, d]
    probs = gate.softmax(dim=1, dtype=work_dtype(kv.dtype)).to(kv.dtype)
    entries = rms_norm((kv * probs).sum(dim=1), norm, eps)  # [n, d]
    cos, sin = cos_sin(rope, torch.arange(n) * rate, work_dtype(kv.dtype))
    return rope_tail(entries, cos.to(kv.device), sin.to(kv.device))


def _compressor(
    w: Weights, fam: ModelFamily, layer: int, where: str, scope: str, x: torch.Tensor,
    spec: AttentionSpec,
) -> torch.Tensor:  # fmt: skip
    """Entries of the compressor at ``where`` (``attn_compressor`` / ``attn_indexer_compressor``)."""
    kv = w.linear(fam.module(f"{where}_wkv_{scope}", layer), x)  # [T, c·d]
    gate = w.linear(fam.module(f"{where}_wgate_{scope}", layer), x)
    ape = w.get(fam.tensor(f"{where}_ape_{scope}", layer))
    norm = w.get(fam.tensor(f"{where}_norm_{scope}", layer))
    return compress(kv, gate, ape, norm, spec.rates[scope], spec.compress, spec.eps)


def _visible(pos: torch.Tensor, n: int, rate: int) -> torch.Tensor:
    """[T, n]: query t may see compressed entry w (``w < (t + 1) // rate``)."""
    return torch.arange(n, device=pos.device)[None, :] < ((pos + 1) // rate)[:, None]


def _indexer_bias(
    w: Weights, fam: ModelFamily, layer: int, x: torch.Tensor, qr: torch.Tensor,
    at: Positions, spec: AttentionSpec, n: int,
) -> torch.Tensor:  # fmt: skip
    """[T, n] additive bias over the n CSA entries: 0 on each query's indexer picks, else -inf."""
    t, rate = x.shape[0], spec.rates["csa"]
    keys = _compressor(w, fam, layer, "attn_indexer_compressor", "csa", x, spec)  # [n, dI]
    q = w.linear(fam.module("indexer_wq_b", layer), qr).view(t, spec.index_heads, -1)
    q = rope_tail(q, *at.compress)  # [T, nI, dI]
    wd = work_dtype(x.dtype)
    scores = F.relu(torch.einsum("thd,sd->ths", q.to(wd), keys.to(wd))) * spec.index_dim**-0.5
    heads = w.linear(fam.module("indexer_weights_proj", layer), x).to(wd)  # [T, nI]
    score = (scores * (heads * spec.index_heads**-0.5)[..., None]).sum(dim=1)  # [T, n]
    visible = _visible(at.pos, n, rate)
    picks = score.masked_fill(~visible, float("-inf")).topk(min(spec.index_topk, n), -1).indices
    picks = torch.where(visible.gather(1, picks), picks, n)  # invalid picks → the spare column
    bias = torch.full((t, n + 1), float("-inf"), device=x.device)
    return bias.scatter_(1, picks, 0.0)[:, :n]


def attention(
    w: Weights, fam: ModelFamily, layer: int, scope: str, x: torch.Tensor, at: Positions,
    spec: AttentionSpec,
) -> torch.Tensor:  # fmt: skip
    """Attention of ``layer`` (``scope``: swa / csa / hca) on normed ``x`` [T, D] → [T, D]."""
    t, hd = x.shape[0], spec.head_dim
    cos, sin = at.main if scope == "swa" else at.compress

    def m(role: str) -> str:
        return fam.module(role, layer)

    qr = rms_norm(w.linear(m("q_a"), x), w.get(fam.tensor("q_a_norm", layer)), spec.eps)
    q = unweighted_rms_norm(w.linear(m("q_b"), qr).view(t, -1, hd), spec.eps)  # [T, H_r, hd]
    q = rope_tail(q, cos, sin)
    kv = rms_norm(w.linear(m("kv"), x), w.get(fam.tensor("kv_norm", layer)), spec.eps)  # [T, hd]
    keys, bias = rope_tail(kv, cos, sin), at.window_mask  # [S, hd], [T, S]
    if scope != "swa":
        entries = _compressor(w, fam, layer, "attn_compressor", scope, x, spec)  # [n, hd]
        n = entries.shape[0]
        if scope == "csa":
            extra = _indexer_bias(w, fam, layer, x, qr, at, spec, n)
        else:
            extra = torch.zeros(t, n, device=x.device)
            extra = extra.masked_fill(~_visible(at.pos, n, spec.rates[scope]), float("-inf"))
        keys, bias = torch.cat([keys, entries]), torch.cat([bias, extra], dim=-1)
    if spec.kv_cache is not None:  # window keys and compressed entries, as the cache holds them
        keys = spec.kv_cache(keys).to(keys.dtype)
    o = _sink_attention(q, keys, bias, w.get(fam.tensor("sinks", layer)), hd**-0.5)
    o = rope_tail(o, cos, -sin)  # [T, H_r, hd]
    groups = o.shape[1] * spec.o_groups // spec.heads  # this rank's groups
    return _grouped_out(w, m("o_a"), m("o_b"), o, groups)


def _sink_attention(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax([q·kᵀ·scale + bias | sink])`` without the sink's column, times the keys (K = V):
    q [T, H, d], keys [S, d], bias [T, S], sinks [H] → [T, H, d]."""
    wd = work_dtype(q.dtype)
    scores = torch.einsum("thd,sd->hts", q, keys) * scale + bias.to(q.dtype)  # [H, T, S]
    sink = sinks.to(wd)[:, None, None].expand(-1, q.shape[0], 1)  # [H, T, 1]
    logits = torch.cat([scores.to(wd), sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = logits.softmax(dim=-1)[..., :-1].to(q.dtype)  # [H, T, S]
    return torch.einsum("hts,sd->thd", probs, keys)


def _grouped_out(w: Weights, o_a: str, o_b: str, o: torch.Tensor, groups: int) -> torch.Tensor:
    """``o_b(concat_g o_a_g(o_g))`` for this rank's heads ``o`` [T, H_r, hd] in ``groups``
    groups → [T, D]."""
    t = o.shape[0]
    full = w.linear(o_a, o.reshape(t, groups, -1))  # [T, G_r, G_r·r]: each group through all
    per = full.shape[-1] // groups  # o_lora_rank
    own = torch.stack([full[:, g, g * per : (g + 1) * per] for g in range(groups)], dim=1)
    return w.linear(o_b, own.reshape(t, -1))  # [T, D]
