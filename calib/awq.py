"""AWQ (activation-aware weight quantization) as pure functions: statistics and weights in,
scales / clip bounds out. No hooks, no I/O, no model; ``calibrate.py`` does the plumbing.

Objective (Lin et al., arXiv 2306.00978; AutoAWQ 0.2.9 ``awq/quantize/quantizer.py``). Linears
``W_i`` [N_i, K] that read the same K input channels — after one RMSNorm, or after one linear whose
output rows can absorb a factor — share a per-channel scale ``s`` [K]:

    s* = argmin_s  Σ_i ‖ Q(W_i · diag(s)) · diag(s)⁻¹ · X_iᵀ  −  W_i · X_iᵀ ‖²_F  /  Σ_i T_i · N_i

``X_i`` [T_i, K] is what linear i sees on the calibration data (one shared X, or each routed
expert its own routed tokens). ``Q_i`` is linear i's quantizer in the artifact: its TARGET
format's quantize → dequantize (``quantizer.py``: ``Quantizer(fmt)``, from the format and the
parameters the recipe assigns it). ``awq-w4a16``: AutoAWQ GEMM W4A16, asymmetric round-to-nearest
per group of ``g`` input channels (:func:`fake_quantize`, its unpacked fast path); ``ct-w4a16``:
compressed-tensors pack-quantized W4A16, symmetric (:func:`fake_quantize_symmetric`); the hybrid's
routed experts: ``int4_cpu`` (symmetric, one scale per row) or ``int4_cpu_group`` (one per ``g``);
its W8A8 linears: ``w8a8_dynamic``'s int8 weights. A linear in a mapping that the artifact keeps
in float (``None``) adds no error. ``diag(s)⁻¹`` is then folded into the producer of X
(:func:`fold_into_norm`, :func:`fold_into_linear`) and ``diag(s)`` into the weights
(:func:`scale_columns`), so the float model is unchanged and only Q sees ``W·diag(s)``.

The seam (``FakeQuant``): ``q(w)`` float32 [N, K] and ``q.group(K)``, the input columns that
share one scale (the whole row for per-channel formats). A new format is calibrated with no
code here or in ``quantizer.py``: a registered format with ``quantize`` / ``dequantize``
(and, if it is group-wise, a ``group_size`` parameter) is its own ``Q``; a faster path giving
the same floats may be added to ``quantizer.FAST_PATHS``. An expert-layer format names its
per-linear twin (``ExpertLayerFormat.linear_format``).

Candidates (AutoAWQ ``_compute_best_scale``, ``duo_scaling=True``), for α = k / grid, k < grid::

    x̄ = mean_t |X[t, :]|                                   # [K] activation magnitude
    w̄ = mean_rows(|W| / max|W| of its group), all W_i       # [K] relative weight magnitude
                                                            # (groups: Q_i.group; float W_i left out)
    s_α = clamp(x̄^α / (w̄^(1-α) + 1e-4), min=1e-4);  s_α /= sqrt(max s_α · min s_α)

(``duo_scaling=False``: ``s_α = x̄^α``). Two additions: the identity ``s = 1`` is always a
candidate (llm-compressor's grid includes it), so the chosen loss never exceeds round-to-
nearest's; and, optionally (``pow2=True``; off by default, as in AutoAWQ), every candidate is
rounded to a power of two
(``2^round(log2 s)``), which makes every fold exact in any binary float format — a BF16 norm
divided by 2^k and a weight times 2^k hold the same digits — so the transformed float model,
router included, computes bit-identical outputs. Candidates that coincide are evaluated once.

Clip (AutoAWQ ``_compute_best_clip``): per output row n and input group j (of ``Q.group``
columns: the whole row for a per-channel format), the bound
``max_val = max|W[n, group j]| · (1 - i / grid)`` for shrink steps ``i < max_shrink · grid``
that minimises ``mean_t (Σ_{c ∈ j} X[t, c] · (Q(clamp(W, ±max_val)) − W)[n, c])²`` over at most
``n_tokens`` evenly strided tokens. The result is stored as the shrink step ``i`` (uint8) and
turned back into bounds by :func:`clip_bounds`, the one function both search and converter use.

Reproducibility (the same transforms, so the same artifact bytes, on every CPU). Float32 BLAS and
vectorised transcendentals differ between x86 code paths (ATen's AVX-512 / AVX2 / scalar kernels,
MKL's per-CPU kernels) by float32 roundings, and the AWQ grid has near-ties that such roundings
flip. So, on the CPU, calibration computes in float64 (``AwqOptions.dtype``; the forward too,
``runtime/forward/precision.py``): activations, statistics, Gram matrices, errors and losses;
differences between code paths are then ~1e-16 relative. Three rules turn those into equal
decisions:

- scale candidates are computed in float64 and rounded to ``SCALE_BITS`` = 12 significant bits
  (exact in float32 and BF16-times-scale exact in float32): a candidate lands on another value
  only if it lies within ~1e-16 of a rounding boundary 2^-12 wide;
- the scale search keeps the earliest candidate (identity first) unless a later one's loss is
  lower by more than ``TIE_RTOL`` = 1e-9 relative;
- the clip search keeps the smaller shrink unless a larger one's error is lower by more than
  ``TIE_RTOL`` relative.

Ties between float32 weight roundings (a quantizer's own arithmetic) are elementwise and exact on
every path. ``tests/calib/test_reproducible.py`` runs the calibrated recipes under ATen's
``default`` / ``avx2`` / ``avx512`` kernels, MKL's AVX2 and SSE4.2 kernels and 1 or 2 threads and
requires the same bytes. An accelerator computes in BF16 matmuls (``matmul_dtype``; errors and
losses in float32) and gives other transforms: ``calibrate``'s ``stats`` says where it ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hetquant.formats import HetquantError
from hetquant.formats import ct_pack_quantized as ct
from hetquant.formats.awq_w4a16 import QMAX, RANGE_EPS
from hetquant.formats.dtypes import divide
from hetquant.runtime.forward.precision import work_dtype

__all__ = [
    "CLIP_BATCH_BYTES",
    "SCALE_BITS",
    "TIE_RTOL",
    "FakeQuant",
    "ScaleSearch",
    "activation_mean",
    "apply_clip",
    "clip_bounds",
    "clip_factors",
    "clip_rows_per_batch",
    "fake_quantize",
    "fake_quantize_symmetric",
    "first_min",
    "fold_into_linear",
    "fold_into_norm",
    "rtn_params",
    "scale_candidates",
    "scale_columns",
    "search_clip",
    "search_scale",
    "weight_mean",
]

SCALE_EPS = 1e-4  # AutoAWQ: (x^α / (w^(1-α) + 1e-4)).clamp(min=1e-4)
WMEAN_EPS = 1e-6  # AutoAWQ: |w| / (max|w| + 1e-6)
_CHUNK = 8192  # token rows per matmul chunk
SCALE_BITS = 12  # significant bits of every scale candidate (module docstring, Reproducibility)
TIE_RTOL = 1e-9  # losses closer than this (relative) are ties: the earlier choice is kept


# -- the quantizer ---------------------------------------------------------------------------


class FakeQuant(Protocol):
    """``Q`` of the objective (module docstring; ``quantizer.Quantizer`` implements it)."""

    def __call__(self, w: torch.Tensor) -> torch.Tensor: ...  # [N, K] → float32 [N, K]

    def group(self, k: int) -> int: ...  # input columns per scale, of k


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 view of ``w`` [N, K] as (N, K/g, g); K must be divisible by g."""
    if w.ndim != 2 or w.shape[1] % group_size:
        raise HetquantError(
            f"awq: weight {list(w.shape)} is not 2-D with in divisible by group {group_size}"
        )
    n, k = w.shape
    return w.to(torch.float32).reshape(n, k // group_size, group_size)


def _round_up(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Positive ``x`` rounded up to the next value of float ``dtype`` (FP16 as ``awq_w4a16``
    stores scales; BF16 / F32 as ``ct_pack_quantized`` may).

    Bit arithmetic instead of ``nextafter``, so it runs on every device: for a positive float
    the next one up has the bit pattern + 1.
    """
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    y = x.to(dtype)
    low = y.to(x.dtype) < x
    up = (y.view(bits) + 1).view(dtype)
    return torch.where(low, up, y)


def rtn_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest parameters of ``AwqW4A16.quantize`` for ``w`` [N, K].

    Returns ``scales`` FP16 [N, K/g] (range widened to contain 0, rounded up) and ``zeros``
    float32 [N, K/g] (integers 0..15): exactly what ``AwqW4A16(g).quantize(w)`` stores, so
    ``quantize(w, scales=, zeros=)`` with them reproduces it.
    """
    lo, hi = torch.aminmax(_grouped(w, group_size), dim=-1)  # (N, K/g) each
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # range widened to contain 0
    span = (hi.double() - lo.double()).clamp(min=RANGE_EPS)  # exact in float64
    s16 = _round_up(divide(span, QMAX))  # (N, K/g)
    z = (-torch.round(lo / s16.float())).clamp(0, QMAX)  # (N, K/g)
    return s16, z


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``AwqW4A16(g).dequantize(AwqW4A16(g).quantize(w))`` without packing: float32 [N, K].

    ``clamp(round(w/s) + z, 0, 15) - z`` is computed as ``clamp(round(w/s), -z, 15 - z)``
    (z is an integer, so both are the same integers), then times ``s`` in float32.
    """
    wg = _grouped(w, group_size)  # (N, K/g, g)
    s16, z = rtn_params(w, group_size)
    s = s16.float()[..., None]  # (N, K/g, 1)
    z = z[..., None]
    q = torch.clamp(torch.round(wg / s), -z, QMAX - z)  # (N, K/g, g): q - z
    return (q * s).reshape(w.shape)  # (N, K)


def fake_quantize_symmetric(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``CtPackQuantized(g, scale_dtype).dequantize(….quantize(w))`` without packing: float32
    [N, K] (``ct_pack_quantized``'s fast path in ``quantizer.FAST_PATHS``). ``s`` = ``absmax /
    7.5`` rounded up to ``scale_dtype`` (floored at FLT_EPSILON), ``q = clamp(round(w / s), -8,
    7)``, then ``q · s``."""
    wg = _grouped(w, group_size)  # (N, K/g, g)
    absmax = wg.abs().amax(dim=-1)  # (N, K/g)
    s = _round_up(divide(absmax.double(), ct.HALF_RANGE).clamp(min=ct.SCALE_EPS), scale_dtype)
    sf = s.float()[..., None]  # (N, K/g, 1)
    q = torch.clamp(torch.round(wg / sf), ct.QMIN, ct.QMAX)  # (N, K/g, g)
    return (q * sf).reshape(w.shape)  # (N, K)


# -- statistics ------------------------------------------------------------------------------


def activation_mean(x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """``mean_t |x[t, :]|`` float64 [K] over the rows of ``x`` [..., K] (or of several)."""
    xs = [x] if isinstance(x, torch.Tensor) else list(x)
    k = xs[0].shape[-1]
    total = torch.zeros(k, dtype=torch.float64, device=xs[0].device)
    rows = 0
    for t in xs:
        t2 = t.reshape(-1, k)
        for chunk in t2.split(_CHUNK):
            total += chunk.abs().sum(0, dtype=torch.float64)
        rows += t2.shape[0]
    return total / max(rows, 1)


def weight_mean(weights: Sequence[torch.Tensor], groups: Sequence[int]) -> torch.Tensor:
    """AutoAWQ's ``w_mean`` float64 [K]: ``|W| / (max|W| of its group + 1e-6)`` (float32)
    averaged over the rows of all ``weights`` (each [N_i, K], its groups of ``groups[i]``
    columns) stacked, accumulated in float64 one weight at a time."""
    total, rows = None, 0
    for w, group_size in zip(weights, groups, strict=True):
        wg = _grouped(w, group_size).abs()  # (N, K/g, g)
        rel = wg / (wg.amax(dim=-1, keepdim=True) + WMEAN_EPS)
        part = rel.reshape(w.shape).sum(0, dtype=torch.float64)  # [K]
        total = part if total is None else total + part
        rows += w.shape[0]
    if total is None:
        raise HetquantError("awq.weight_mean: no weights given")
    return total / rows


# -- scale search ----------------------------------------------------------------------------


def scale_candidates(
    x_mean: torch.Tensor,
    w_mean: torch.Tensor,
    grid: int = 20,
    *,
    duo_scaling: bool = True,
    pow2: bool = False,
) -> list[tuple[float | None, torch.Tensor]]:
    """(α, s [K] float32) candidates, identity first (α None), duplicates removed; computed in
    float64 and rounded to ``SCALE_BITS`` significant bits (module docstring)."""
    x_mean, w_mean = x_mean.to(torch.float64), w_mean.to(torch.float64)
    out: list[tuple[float | None, torch.Tensor]] = [
        (None, torch.ones_like(x_mean, dtype=torch.float32))
    ]
    made: list[tuple[float, torch.Tensor]] = []
    for k in range(grid):
        a = k / grid
        if duo_scaling:
            s = (x_mean.pow(a) / (w_mean.pow(1 - a) + SCALE_EPS)).clamp(min=SCALE_EPS)
        else:
            s = x_mean.pow(a).clamp(min=SCALE_EPS)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        if pow2:
            s = torch.exp2(torch.round(torch.log2(s)))
        made.append((a, _significant(s, SCALE_BITS)))
    host = torch.stack([out[0][1], *(s for _, s in made)]).cpu() if made else None  # one sync
    kept = [0]  # rows of ``host`` kept
    for j, (a, s) in enumerate(made, start=1):
        if not any(torch.equal(host[j], host[i]) for i in kept):
            kept.append(j)
            out.append((a, s))
    return out


def _significant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Positive float64 ``x`` rounded to ``bits`` significant bits (ties to even): float32,
    exactly (``bits`` ≤ 24)."""
    m, e = torch.frexp(x)  # x = m · 2^e, m in [0.5, 1); times / by 2^bits are exact
    return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e).to(torch.float32)


def first_min(losses: Sequence[float], rtol: float = TIE_RTOL) -> int:
    """Index of the smallest loss, the earliest kept unless a later one is lower by more than
    ``rtol`` relative (module docstring, Reproducibility)."""
    best = 0
    for c in range(1, len(losses)):
        if losses[c] < losses[best] * (1 - rtol):
            best = c
    return best


@dataclass(frozen=True)
class ScaleSearch:
    """Outcome of :func:`search_scale`.

    ``scales`` float32 [K]; ``ratio`` the chosen α (None: identity won); ``loss`` and
    ``identity_loss`` the objective (mean squared output error) at the choice and at ``s = 1``
    (plain round-to-nearest); ``losses`` every (α, loss) evaluated, identity first.
    """

    scales: torch.Tensor
    ratio: float | None
    loss: float
    identity_loss: float
    losses: tuple[tuple[float | None, float], ...]


def search_scale(
    weights: Sequence[torch.Tensor],
    x: torch.Tensor | Sequence[torch.Tensor],
    quantizers: Sequence[FakeQuant | None],
    grid: int = 20,
    *,
    x_mean: torch.Tensor | None = None,
    duo_scaling: bool = True,
    pow2: bool = False,
    matmul_dtype: torch.dtype = torch.float32,
) -> ScaleSearch:
    """The AWQ scale shared by ``weights`` (each [N_i, K]); see the module docstring.

    ``quantizers``: each weight's ``Q`` (None: kept in float, adds no error; at least one must
    be given). ``x``: the input [T, K] all weights read, or one input [T_i, K] per weight (T_i
    may be 0: a routed expert that saw no token adds nothing to the objective); a Sequence may
    make its items on demand, so that only one expert's rows exist at a time. ``x_mean``: the
    activation statistic (default: :func:`activation_mean` of ``x``). The output error of each candidate is
    computed as ``X · (Q(W·diag(s))·diag(s)⁻¹ − W)ᵀ`` (equal to the objective's difference, with
    no cancellation), through the Gram matrix ``XᵀX`` when T_i > K. Matmuls run in
    ``matmul_dtype`` (bfloat16 is enough to rank candidates on an accelerator; float64 makes the
    choice the same on every CPU); the Gram matrices and error sums in float32 (float64 with
    float64 matmuls). Ties within ``TIE_RTOL`` keep the earlier candidate (identity first).
    """
    ws, qs = list(weights), list(quantizers)
    xs = [x] * len(ws) if isinstance(x, torch.Tensor) else x  # may be a lazy Sequence
    if not ws or len(xs) != len(ws) or len(qs) != len(ws):
        raise HetquantError(
            f"awq.search_scale: {len(ws)} weights, {len(xs)} inputs, {len(qs)} quantizers"
        )
    quant = [(w, q) for w, q in zip(ws, qs, strict=True) if q is not None]
    if not quant:
        raise HetquantError("awq.search_scale: no quantized weight to balance")
    if x_mean is None:
        x_mean = activation_mean(xs[0] if isinstance(x, torch.Tensor) else xs)
    w_mean = weight_mean([w for w, _ in quant], [q.group(w.shape[1]) for w, q in quant])
    cands = scale_candidates(x_mean, w_mean, grid, duo_scaling=duo_scaling, pow2=pow2)
    dev = quant[0][0].device
    sq = [torch.zeros((), dtype=torch.float64, device=dev) for _ in cands]  # no sync per step
    count = 0
    grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(x) → (x kept alive, xᵀx)
    for i, (w, q) in enumerate(zip(ws, qs, strict=True)):
        if q is None:
            continue
        xi = xs[i]
        t = xi.reshape(-1, w.shape[1])
        if t.shape[0] == 0:
            continue
        count += t.shape[0] * w.shape[0]
        w32 = w.to(torch.float32)
        gram = None
        if t.shape[0] > w.shape[1]:
            if id(xi) not in grams:
                grams[id(xi)] = (xi, _gram(t, matmul_dtype))
            gram = grams[id(xi)][1]
        for c, (_, s) in enumerate(cands):
            err = q(w32 * s) / s - w32  # (N, K)
            sq[c] += _sq_out(t, err, gram, matmul_dtype)
    losses = [float(v) / max(count, 1) for v in torch.stack(sq).cpu()]
    best = first_min(losses)
    return ScaleSearch(
        scales=cands[best][1],
        ratio=cands[best][0],
        loss=losses[best],
        identity_loss=losses[0],
        losses=tuple((a, v) for (a, _), v in zip(cands, losses, strict=True)),
    )


def _gram(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``xᵀx`` [K, K] in ``work_dtype(dtype)``, accumulated over token chunks."""
    k, acc = x.shape[-1], work_dtype(dtype)
    g = torch.zeros(k, k, dtype=acc, device=x.device)
    for chunk in x.split(_CHUNK):
        c = chunk.to(dtype)
        g += (c.T @ c).to(acc)
    return g


def _sq_out(x: torch.Tensor, err: torch.Tensor, gram: torch.Tensor | None, dtype) -> torch.Tensor:
    """``‖x · errᵀ‖²_F`` for x [T, K], err [N, K] (via ``gram = xᵀx`` when given): a float64
    scalar on err's device (left there: the searches read all losses back at once)."""
    if gram is not None:
        e = err.to(gram.dtype)
        return ((e @ gram) * e).sum(dtype=torch.float64)
    e, acc = err.to(dtype), work_dtype(dtype)
    total = torch.zeros((), dtype=torch.float64, device=err.device)
    for chunk in x.split(_CHUNK):
        total += (chunk.to(dtype) @ e.T).to(acc).pow(2).sum(dtype=torch.float64)
    return total


# -- clip search -----------------------------------------------------------------------------


def clip_factors(grid: int, max_shrink: float) -> torch.Tensor:
    """``1 - i / grid`` for the shrink steps ``i < int(max_shrink · grid)``, float32."""
    return torch.tensor([1 - i / grid for i in range(int(max_shrink * grid))], dtype=torch.float32)


def clip_bounds(w: torch.Tensor, shrink: torch.Tensor, group_size: int, factors: torch.Tensor):
    """``max|W| of each group · factors[shrink]``: float32 [N, K/g] bounds for ``w`` [N, K]."""
    amax = _grouped(w, group_size).abs().amax(dim=-1)  # (N, K/g)
    return amax * factors.to(amax.device)[shrink.long()]


def apply_clip(w: torch.Tensor, bounds: torch.Tensor, group_size: int) -> torch.Tensor:
    """``clamp(w, -bound, bound)`` per group: float32 [N, K]."""
    wg = _grouped(w, group_size)
    b = bounds[..., None]  # (N, K/g, 1)
    return torch.maximum(torch.minimum(wg, b), -b).reshape(w.shape)


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    q: FakeQuant,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    rows_per_batch: int | None = None,
) -> torch.Tensor:
    """Best shrink step per (row, group) for ``w`` [N, K] quantized by ``q`` (groups of
    ``g = q.group(K)`` columns) on inputs ``x`` [T, K]: uint8 [N, K/g].

    See the module docstring. Tokens are taken every ``max(1, T // n_tokens)``-th (AutoAWQ).
    With no token every step is 0 (no clipping). Errors are computed in ``work_dtype`` of
    ``x``'s dtype (float64 for float64 inputs); a larger shrink replaces a smaller one only if
    its error is lower by more than ``TIE_RTOL`` relative.
    ``rows_per_batch``: rows searched together (default :func:`clip_rows_per_batch`: AutoAWQ's
    256 on the CPU, as many as fit a working set of ``CLIP_BATCH_BYTES`` on an accelerator,
    where launching ~15 kernels per 256 rows and step dominated: 0.15 s of a DeepSeek
    down_proj's 0.16 s on an H100).
    """
    n, k = w.shape
    group_size = q.group(k)
    groups = k // group_size
    best = torch.zeros(n, groups, dtype=torch.uint8, device=w.device)
    t = x.reshape(-1, k)
    if t.shape[0] == 0:
        return best
    acc = work_dtype(x.dtype)
    t = t[:: max(1, t.shape[0] // n_tokens)].to(acc)
    xg = t.reshape(-1, groups, group_size).transpose(0, 1)  # (G, T', g)
    factors = clip_factors(grid, max_shrink).to(w.device)
    rows = rows_per_batch or clip_rows_per_batch(w.device, k, groups, t.shape[0])
    for r0 in range(0, n, rows):
        wr = w[r0 : r0 + rows].to(torch.float32)  # (n', K)
        wg = wr.reshape(wr.shape[0], groups, group_size)
        amax = wg.abs().amax(dim=-1)  # (n', G)
        best_err = torch.full(amax.shape, float("inf"), dtype=acc, device=w.device)
        best_i = torch.zeros(amax.shape, dtype=torch.uint8, device=w.device)
        for i in range(factors.numel()):
            b = (amax * factors[i])[..., None]  # (n', G, 1)
            clipped = torch.maximum(torch.minimum(wg, b), -b).reshape(wr.shape)
            d = (q(clipped) - wr).reshape(wg.shape).to(acc)  # (n', G, g)
            out = torch.bmm(xg, d.permute(1, 2, 0))  # (G, T', n'): per-group partial outputs
            err = out.pow(2).mean(dim=1).T  # (n', G)
            better = err < best_err * (1 - TIE_RTOL)
            best_err = torch.where(better, err, best_err)
            best_i = torch.where(better, i, best_i)  # no host sync per step
        best[r0 : r0 + rows] = best_i
    return best


CLIP_BATCH_BYTES = 1 << 30  # an accelerator's working set per clip-search row batch


def clip_rows_per_batch(device: torch.device, k: int, groups: int, tokens: int) -> int:
    """Rows :func:`search_clip` searches together for a weight of ``k`` input columns in
    ``groups`` groups and ``tokens`` sampled tokens: 256 on the CPU (AutoAWQ's batch; the CPU
    path's results stay as they were), else as many as keep the float32 working set — the
    per-group outputs (``groups · tokens`` per row) and ~4 weight-sized temporaries (``k`` per
    row) — under ``CLIP_BATCH_BYTES``, at least 256."""
    if device.type == "cpu":
        return 256
    per_row = 4 * (groups * tokens + 4 * k)  # bytes
    return max(256, CLIP_BATCH_BYTES // per_row)


# -- folding ---------------------------------------------------------------------------------


def _dt(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """float32, or float64 when either operand is float64."""
    return torch.promote_types(torch.float32, torch.promote_types(a.dtype, b.dtype))


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RMSNorm weight [K] ÷ s: the norm then outputs ``x · diag(s)⁻¹`` (float32 or 64)."""
    dt = _dt(norm_weight, s)
    return norm_weight.to(dt) / s.to(dt)


def fold_into_linear(
    prev_weight: torch.Tensor, s: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Previous linear's output rows ÷ s (all rows, or ``rows`` [K] index): a float32 (or 64)
    copy."""
    dt = _dt(prev_weight, s)
    out, s = prev_weight.to(dt), s.to(dt)
    if rows is None:
        return out / s[:, None]
    out = out.clone()
    out[rows] = out[rows] / s[:, None]
    return out


def scale_columns(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``W · diag(s)``: input column c times s[c] (float32 or 64) — the balanced weight, or the
    router compensated for a fold into the norm it shares."""
    dt = _dt(w, s)
    return w.to(dt) * s.to(dt)
