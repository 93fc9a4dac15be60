"""The quantizer ``Q`` of the AWQ objective (``calib/awq.py`` states it): the ``FakeQuant`` seam
and the fast unpacked paths of the two W4A16 formats, AutoAWQ GEMM (asymmetric, FP16 scales)
and compressed-tensors pack-quantized (symmetric); plus the grouped view every AWQ step uses.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hetquant.formats import HetquantError
from hetquant.formats import ct_pack_quantized as ct
from hetquant.formats.awq_w4a16 import QMAX, RANGE_EPS
from hetquant.formats.dtypes import divide

__all__ = [
    "FakeQuant",
    "fake_quantize",
    "fake_quantize_symmetric",
    "grouped",
    "rtn_params",
]


class FakeQuant(Protocol):
    """``Q`` of the objective (module docstring; ``quantizer.Quantizer`` implements it)."""

    def __call__(self, w: torch.Tensor) -> torch.Tensor: ...  # [N, K] → float32 [N, K]

    def group(self, k: int) -> int: ...  # input columns per scale, of k


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
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
    lo, hi = torch.aminmax(grouped(w, group_size), dim=-1)  # (N, K/g) each
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
    wg = grouped(w, group_size)  # (N, K/g, g)
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
    wg = grouped(w, group_size)  # (N, K/g, g)
    absmax = wg.abs().amax(dim=-1)  # (N, K/g)
    s = _round_up(divide(absmax.double(), ct.HALF_RANGE).clamp(min=ct.SCALE_EPS), scale_dtype)
    sf = s.float()[..., None]  # (N, K/g, 1)
    q = torch.clamp(torch.round(wg / sf), ct.QMIN, ct.QMAX)  # (N, K/g, g)
    return (q * sf).reshape(w.shape)  # (N, K)
