"""Lossless repacks of one linear's stored source tensors into a target format variant.

``LINEAR_REPACKS[(source format, target format)]`` says whether a source variant's codes and
scales fit a target variant as they are (``holds``: None when they do, else why not) and carries
them over without dequantizing (``repack``). A recipe whose target has a repack keeps
quantization-aware-trained codes (Kimi K2 Thinking's compressed-tensors INT4, group 32) where the
target holds them, and refuses to re-quantize them otherwise unless asked
(``convert/recipes/quantized.py``); the converter repacks instead of re-quantizing when ``holds``
(``convert/engine/jobs.py``). ``formats/expert_repack.py`` is the same for stacked CPU expert layers.

| source | target | holds when | how |
|---|---|---|---|
| ``ct_pack_quantized`` | ``ct_pack_quantized`` | same group size and scale dtype | ``weight_packed`` and ``weight_scale`` as stored; ``weight_shape`` in the target's integer dtype (the same two numbers) |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._lazy import torch
from .base import all_finite
from .dtypes import torch_dtype
from .errors import HetquantError

__all__ = ["LINEAR_REPACKS", "LinearRepack"]


@dataclass(frozen=True)
class LinearRepack:
    """``holds(source variant, target variant)`` → None or the reason the codes do not fit;
    ``repack(source stored tensors, target variant)`` → the target's stored tensors."""

    holds: Callable[[Any, Any], str | None]
    repack: Callable[[Mapping[str, torch.Tensor], Any], dict[str, torch.Tensor]]


def _ct_holds(src: Any, dst: Any) -> str | None:
    if (src.group_size, src.scale_dtype) == (dst.group_size, dst.scale_dtype):
        return None
    return (
        f"the source's group {src.group_size} with {src.scale_dtype} scales does not fit "
        f"group {dst.group_size} with {dst.scale_dtype} scales"
    )


def _ct_repack(stored: Mapping[str, torch.Tensor], dst: Any) -> dict[str, torch.Tensor]:
    for key in ("weight_zero_point", "weight_g_idx"):
        if key in stored:
            raise HetquantError(f"ct_pack_quantized: {key} present; it cannot be repacked")
    if not all_finite(stored["weight_scale"]):
        raise HetquantError("ct_pack_quantized: weight_scale contains NaN or Inf; corrupt source")
    shape = stored["weight_shape"]
    return {
        "weight_packed": stored["weight_packed"],
        "weight_scale": stored["weight_scale"],
        "weight_shape": shape.to(torch_dtype(dst.shape_dtype)),  # (2,): (out, in)
    }


LINEAR_REPACKS: dict[tuple[str, str], LinearRepack] = {
    ("ct_pack_quantized", "ct_pack_quantized"): LinearRepack(_ct_holds, _ct_repack),
}
