"""Recipe ``bf16``: every quantized source weight (FP8 blocks, compressed-tensors INT4, ...)
dequantized exactly to BF16, everything else copied byte for byte.

What DeepSeek's ``fp8_cast_bf16.py`` does, on CPU and streaming; the baseline for engines without FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetquant.formats.families import TensorRole

from . import serving
from .base import Recipe, Target, keep, register_recipe

__all__ = ["Bf16Recipe"]


@dataclass(frozen=True)
class Bf16Recipe(Recipe):
    def assign(self, role: TensorRole, source_fmt: str) -> Target:
        return keep(source_fmt)


register_recipe(
    Bf16Recipe(
        "bf16",
        "every FP8 weight dequantized to BF16 (DeepSeek's fp8_cast_bf16, on CPU, streaming)",
        tags=("bf16",),
        library="transformers",
        serving=serving.PLAIN,
    )
)
