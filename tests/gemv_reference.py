"""Float64 references and derived error bounds for the INT4 GEMV and the CPU expert pool, shared
by ``test_expert_pool.py`` (per-channel ``int4_cpu``) and ``test_int4_gemv_group.py`` (grouped
``int4_cpu_group``); the bounds are those of the ``int4_gemv`` module docstring.

For one GEMV, with ``W = s·(c − 8)`` the exact weights::

    native:  |ŷ − y| ≤ Σ_k |W_k| · amax|x| · 2^-P + 2^-24·|y|
                       (+ grouped: (nb/8 + 3) · 2^-53 · Σ_k |W_k| (|x_k| + amax·2^-P))
    torch:   |ŷ − y| ≤ (m + 2) · 2^-24 · Σ_k |W_k||x_k|, m = K/2 (per-channel) or K (grouped)

(P = 22, or 14 for ``precision="fast"``; nb = K / 32). An expert ``D·(silu(G x) ⊙ U x)`` carries
them to first order as described in ``test_expert_pool.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hetquant.formats import int4_cpu

__all__ = [
    "U",
    "assert_within",
    "codes_q",
    "expert_bound",
    "gemv_bound",
    "gemv_ref",
    "grouped_native_order",
    "order_sensitive_grouped",
    "routed_ref_and_bound",
    "routing",
    "weights",
]

U = 2.0**-24
Dequant = Callable[[dict[str, torch.Tensor], int], tuple[torch.Tensor, ...]]


def codes_q(packed: torch.Tensor) -> torch.Tensor:
    """Packed U8 [..., N, K/2] → q = c − 8 as float64 [..., N, K] (even element in low nibble)."""
    p = packed.to(torch.int64)
    return (torch.stack([p & 15, p >> 4], dim=-1).reshape(*p.shape[:-1], -1) - 8).double()


def weights(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact float64 weights [N, K]: per-channel scale [N] or grouped [N, K/g]."""
    q = codes_q(packed)
    if scale.ndim == 1:
        return q * scale.double()[:, None]
    return q * scale.double().repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def gemv_ref(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float64 y = x @ W.T with exact weights."""
    return x.double() @ weights(packed, scale).T


def grouped_native_order(
    packed: torch.Tensor, scale: torch.Tensor, m: torch.Tensor, e: int, order: str = "native"
) -> torch.Tensor:
    """The grouped native kernel's float32 result, bit for bit, for activations on its grid:
    x = m · 2^e with int64 digits-to-be ``m`` [T, K] (|m| < 2^22, the token's fixed point).

    ``order="native"`` is the documented epilogue (``int4_gemv`` module docstring): exact block
    sums A_b = Σ (c − 8)·m, s_b·A_b (exact in float64) added to partial b mod 8 in increasing b,
    ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), times 2^e, rounded once to float32, zero
    as +0. ``order="sequential"``: one running float64 sum over b instead (for tests to show that
    their inputs tell the two apart)."""
    q = codes_q(packed).to(torch.int64)  # [N, K]
    n, k = q.shape
    nb = k // 32
    a = (q[None] * m[:, None, :]).reshape(m.shape[0], n, nb, 32).sum(-1)  # [T, N, nb] exact
    s = scale.double().repeat_interleave(nb // scale.shape[1], dim=1)  # [N, nb]
    prod = s[None] * a.double()  # exact: 8 significant bits times |A| <= 2^30
    if order == "sequential":
        v = torch.zeros(prod.shape[:2], dtype=torch.float64)
        for b in range(nb):
            v += prod[..., b]
    else:
        p = torch.zeros(*prod.shape[:2], 8, dtype=torch.float64)
        for b in range(nb):
            p[..., b % 8] += prod[..., b]
        v = ((p[..., 0] + p[..., 4]) + (p[..., 2] + p[..., 6])) + (
            (p[..., 1] + p[..., 5]) + (p[..., 3] + p[..., 7])
        )
    return (v * 2.0**e).to(torch.float32) + 0.0  # + 0.0: -0 -> +0


# Per group size: (first block of a group within a window of 16 blocks, offset in blocks of
# its mirror): +8 lands in the same partial sum p[b mod 8], +4 in the one it meets first in
# the final ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)).
_MIRRORS = {32: ((0, 8), (1, 4)), 64: ((0, 8), (2, 4)), 128: ((0, 4),)}


def order_sensitive_grouped(n: int, k: int, t: int, g: int, seed: int):
    """Codes, bf16 scales and fixed-point activations m (x = m · 2^-21 exactly) where, in every
    window of 16 blocks, a few groups carry scales ±2^30..2^40 and their mirrors (_MIRRORS) the
    negated codes, the same activations and the same scale: the huge products cancel exactly in
    the documented order before the small terms (scales 2^-10..2^0) of other partials meet
    them; any other order loses those small terms."""
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    codes = torch.randint(1, 16, (n, k), generator=gen)  # 16 - c is a code too
    m = torch.randint(-(2**22) + 1, 2**22, (t, k), generator=gen)
    m[:, 0] = 3 << 20  # amax = 1.5: the kernel's fixed point is x · 2^21, so X = m exactly
    expo = torch.randint(-10, 1, (n, k // g), generator=gen)
    sign = torch.randint(0, 2, (n, k // g), generator=gen) * 2 - 1
    for w0 in range(0, nb - 15, 16):  # whole windows
        for b, off in _MIRRORS[g]:
            e0, e1, d = 32 * (w0 + b), 32 * (w0 + b) + g, 32 * off
            codes[:, e0 + d : e1 + d] = 16 - codes[:, e0:e1]
            m[:, e0 + d : e1 + d] = m[:, e0:e1]
            j, jj = e0 // g, (e0 + d) // g
            expo[:, j] = expo[:, jj] = torch.randint(30, 41, (n,), generator=gen)
            sign[:, jj] = sign[:, j]
    scale = (sign * 2.0**expo).bfloat16()
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)
    return packed, scale, m


def gemv_bound(
    packed: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    backend: str,
    bits: int = 22,
) -> torch.Tensor:
    w_abs = weights(packed, scale).abs()  # [N, K]
    k = w_abs.shape[1]
    x64 = x.double().reshape(-1, k)
    if backend == "torch":
        m = k / 2 if scale.ndim == 1 else k
        return (m + 2) * U * (x64.abs() @ w_abs.T)
    amax = x64.abs().amax(-1, keepdim=True)  # [T, 1]
    bound = w_abs.sum(-1) * amax * 2.0**-bits + U * y.abs()
    if scale.ndim == 2:  # float64 sums of the per-block products
        bound += (
            (k / 32 / 8 + 3) * 2.0**-53 * (x64.abs() @ w_abs.T + w_abs.sum(-1) * amax * 2.0**-bits)
        )
    return bound


def expert_bound(
    layer: dict[str, torch.Tensor], e: int, x64: torch.Tensor, dequant: Dequant | None = None
) -> torch.Tensor:
    """First-order bound of the native pool's expert e on x [T, H] (``dequant`` gives the
    expert's float weights; default ``int4_cpu.dequantize_expert``)."""
    gate, up, down = (w.double() for w in (dequant or int4_cpu.dequantize_expert)(layer, e))
    ga, ua, da = gate.abs(), up.abs(), down.abs()
    g, u = x64 @ gate.T, x64 @ up.T
    amax_x = x64.abs().amax(-1, keepdim=True)
    dg = ga.sum(-1) * amax_x * 2.0**-22 + U * g.abs() + U * (x64.abs() @ ga.T)
    du = ua.sum(-1) * amax_x * 2.0**-22 + U * u.abs() + U * (x64.abs() @ ua.T)
    act = F.silu(g) * u
    dact = 1.1 * dg * u.abs() + F.silu(g).abs() * du + dg * du + 2.0**-21 * act.abs()
    amax_a = (act.abs() + dact).amax(-1, keepdim=True)
    y = act @ down.T
    return dact @ da.T + da.sum(-1) * amax_a * 2.0**-22 + U * (y.abs() + act.abs() @ da.T)


def _forward(
    layer: dict[str, torch.Tensor], e: int, x64: torch.Tensor, dequant: Dequant
) -> torch.Tensor:
    gate, up, down = (w.double() for w in dequant(layer, e))
    return (F.silu(x64 @ gate.T) * (x64 @ up.T)) @ down.T


def routed_ref_and_bound(
    layer: dict[str, torch.Tensor],
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    subpools: int,
    dequant: Dequant | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k w_k · expert_{e_k}(x) in float64 (weights cast to x's dtype) and its bound."""
    dequant = dequant or int4_cpu.dequantize_expert
    x64 = x.double()
    w64 = w.to(x.dtype).double()
    ref = torch.zeros_like(x64)
    bound = torch.zeros_like(x64)
    mag = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y = _forward(layer, e, x64[t : t + 1], dequant)
            ref[t] += w64[t, j] * y[0]
            mag[t] += (w64[t, j] * y[0]).abs()
            bound[t] += w64[t, j].abs() * expert_bound(layer, e, x64[t : t + 1], dequant)[0]
    bound += (ids.shape[1] * subpools + 1) * U * mag
    if x.dtype != torch.float32:
        bound += 2.0**-8 * ref.abs()
    return ref, bound


def routing(num_tokens: int, num_experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    w = torch.rand(num_tokens, k, generator=g) + 0.1
    return ids, w


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - ref).abs()
    worst = (err / (2 * bound)).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3e} exceeds 2x bound (ratio {worst:.3f})"
