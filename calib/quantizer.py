"""``Q`` of the AWQ objective for one linear: its target format's quantize → dequantize.

The seam between calibration and the formats (``awq.py``'s docstring states the objective). A
linear the artifact stores in format ``F`` — a registered ``WeightFormat`` with the recipe's
parameters, or an expert-layer format through its ``linear_format()`` — is calibrated with
``Quantizer(F)``:

- ``q(w)``: float32 [N, K], ``F.dequantize(F.quantize(w))`` bit for bit. A format may add a
  faster path that gives the same floats to ``FAST_PATHS`` (no packing: ``awq_w4a16``
  :func:`awq.fake_quantize`, ``ct_pack_quantized`` :func:`awq.fake_quantize_symmetric`,
  ``w4a8_dynamic`` without its pair packing);
  ``tests/calib/test_quantizer.py`` checks each against the round trip.
- ``q.group(k)``: the input columns that share one scale: the format's ``group_size`` parameter
  where it has one, else the whole row of ``k`` (per-channel formats: ``int4_cpu``,
  ``w8a8_dynamic``). The clip search and AutoAWQ's ``w̄`` work per (row, group).

What a format must satisfy to be calibrated this way: rows are quantized independently (a
block of rows quantizes as those rows of the whole weight do: the clip search batches rows) and a
(row, group)'s codes depend on that group's values only. Every per-row or per-group format does;
one with a per-tensor scale (NVFP4's global FP32 scale) does not and would need its own search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hetquant.formats import (
    EXPERT_FORMATS,
    FORMATS,
    ExpertLayerFormat,
    HetquantError,
    WeightFormat,
    get_format,
)
from hetquant.formats import w4a8_npu as w4a8
from hetquant.formats.dtypes import divide, torch_dtype

from . import awq

__all__ = ["FAST_PATHS", "Quantizer", "quantizer_for", "quantizer_of"]

FAST_PATHS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "awq_w4a16": lambda fmt, w: awq.fake_quantize(w, fmt.group_size),
    "ct_pack_quantized": lambda fmt, w: awq.fake_quantize_symmetric(
        w, fmt.group_size, torch_dtype(fmt.scale_dtype)
    ),
    "w4a8_dynamic": lambda fmt, w: _w4a8_round_trip(w),
}


def _w4a8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``W4A8Dynamic.dequantize(….quantize(w))`` without packing or ``scale_bias`` (derived
    data): float32 [N, K]; ``s = max(rowmax|w| / 7, FLT_EPSILON)``, ``q = clamp(round(w / s),
    -8, 7)``, then ``q · s`` (``formats/w4a8_npu.py``; offset 0)."""
    w = w.to(torch.float32)
    s = divide(w.abs().amax(dim=1, keepdim=True), w4a8.QMAX).clamp(min=w4a8.SCALE_FLOOR)  # (N, 1)
    return torch.round(w / s).clamp(w4a8.QMIN, w4a8.QMAX) * s  # (N, K)


@dataclass(frozen=True)
class Quantizer:
    """A linear's target format as calibration's ``Q`` (module docstring)."""

    fmt: WeightFormat

    def group(self, k: int) -> int:
        """Input columns per scale for a weight of ``k`` input columns."""
        return int(self.fmt.params.get("group_size") or k)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(w))`` of ``w`` [N, K]: float32 [N, K]."""
        fast = FAST_PATHS.get(self.fmt.name)
        if fast is not None:
            return fast(self.fmt, w)
        return self.fmt.dequantize(self.fmt.quantize(w.to(torch.float32))).to(w.device)

    def check(self, name: str, shape: tuple[int, int]) -> None:
        """Raise HetquantError naming tensor ``name`` unless the format stores ``shape``."""
        try:
            self.fmt.stored(shape)
        except HetquantError as e:
            raise HetquantError(f"{name}: {e}") from None

    def spec(self) -> list[Any]:
        """``[format name, params]``: what ``quantizer_for`` takes back (JSON)."""
        return [self.fmt.name, dict(self.fmt.params)]


def quantizer_for(fmt: str, params: Mapping[str, Any] | None = None) -> Quantizer:
    """The quantizer of the format named ``fmt`` (a linear or an expert-layer format) with
    ``params`` (a saved ``Quantizer.spec``)."""
    params = dict(params or {})
    if fmt in EXPERT_FORMATS:
        return quantizer_of(dataclasses.replace(EXPERT_FORMATS[fmt], **params))
    if fmt not in FORMATS:
        known = sorted(FORMATS) + sorted(EXPERT_FORMATS)
        raise HetquantError(f"calibration: unknown target format {fmt!r}; known: {known}")
    return Quantizer(get_format(fmt, **params))


def quantizer_of(fmt: WeightFormat | ExpertLayerFormat) -> Quantizer:
    """The quantizer of format object ``fmt``: itself, or an expert layout's per-linear format."""
    if not isinstance(fmt, ExpertLayerFormat):
        return Quantizer(fmt)
    try:
        return Quantizer(fmt.linear_format())
    except NotImplementedError as e:
        raise HetquantError(f"calibration: {e}; it cannot be calibrated") from None
