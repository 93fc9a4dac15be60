"""Unquantized BF16 — the "FLOAT" format of Ascend descriptions and the ``bf16`` recipe.

Stored tensors for a linear weight [out, in]: ``weight`` BF16 [out, in]. Dequantize: f32(weight).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ._lazy import torch
from .arrays import NotNative, RowsInto, float_row_arrays
from .base import Streaming, TensorMeta, WeightFormat, float_rows, register

__all__ = ["Bf16"]


@dataclass(frozen=True)
class Bf16(WeightFormat):
    """A plain BF16 weight."""

    name: ClassVar[str] = "bf16"
    native_quantize: ClassVar[bool] = True  # quantize_array
    native_source: ClassVar[bool] = True  # source_row_arrays
    stores_bf16_rows: ClassVar[bool] = True  # quantize_array: the rows as given
    keys: ClassVar[frozenset[str]] = frozenset({"weight"})

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Bf16, tuple[int, int]]:
        n, k = metas["weight"].shape  # 2-D only: a 1-D weight is a norm, not a linear
        return self, (n, k)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        return Streaming(self, {"weight": 0})

    def source_rows(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        return float_rows(name, tensors["weight"])

    def source_row_arrays(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int],
        into: RowsInto | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:  # fmt: skip
        return float_row_arrays(name, arrays["weight"])  # views of the source: nothing computed

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        return {"weight": TensorMeta("BF16", tuple(shape))}

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"weight": (0, 1)}

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        return {"weight": weight.to(torch.bfloat16).contiguous()}

    def quantize_array(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`quantize` of BF16 rows (their bits, ``uint16``): as they are."""
        if rows.dtype != np.uint16:
            raise NotNative(f"bf16: rows of {rows.dtype} need rounding")
        return {"weight": rows}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return tensors["weight"].to(torch.float32)


register(Bf16())
