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
every path. ``tests/convert/test_golden_artifacts.py`` (``OTHER_CPUS``) runs the calibrated
recipes under ATen's ``default`` / ``avx2`` / ``avx512`` kernels, MKL's AVX2 and SSE4.2 kernels
and 1 or 2 threads and requires the same bytes. An accelerator computes in BF16 matmuls (``matmul_dtype``; errors and
losses in float32) and gives other transforms: ``calibrate``'s ``stats`` says where it ran.

Where the code lives (this module re-exports it all): the quantizer seam and the W4A16 fast
paths in ``awq_quant.py``, the activation / weight statistics and output errors in
``awq_stats.py``, the scale search in ``awq_scale.py``, the clip search in ``awq_clip.py``, the
folds that apply a scale in ``awq_fold.py``.
"""

from __future__ import annotations

from .awq_clip import (
    CLIP_BATCH_BYTES,
    apply_clip,
    clip_bounds,
    clip_factors,
    clip_rows_per_batch,
    search_clip,
)
from .awq_fold import fold_into_linear, fold_into_norm, scale_columns
from .awq_quant import FakeQuant, fake_quantize, fake_quantize_symmetric, rtn_params
from .awq_scale import (
    SCALE_BITS,
    SCALE_EPS,
    TIE_RTOL,
    ScaleSearch,
    first_min,
    scale_candidates,
    search_scale,
)
from .awq_stats import activation_mean, weight_mean

__all__ = [
    "CLIP_BATCH_BYTES",
    "SCALE_BITS",
    "SCALE_EPS",
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
