"""Lossless repacks of one linear's stored source tensors into a target format variant.

``LINEAR_REPACKS[(source format, target format)]`` says whether a source variant's codes and
scales fit a target variant as they are (``holds``: None when they do, else why not) and carries
them over without dequantizing (``repack``). A recipe whose target has a repack keeps
quantization-aware-trained codes (Kimi K2 Thinking's compressed-tensors INT4, group 32) where the
target holds them, and refuses to re-quantize them otherwise unless asked
(``convert/recipes/requantize.py``); the converter repacks instead of re-quantizing when ``holds``
(``convert/engine/jobs.py``). ``formats/expert_repack.py`` is the same for stacked CPU expert layers.

| source | target | holds when | how |
|---|---|---|---|
| ``ct_pack_quantized`` | ``ct_pack_quantized`` | same group size and scale dtype | ``weight_packed`` and ``weight_scale`` as stored; ``weight_shape`` in the target's integer dtype (the same two numbers) |
| ``fp4_e2m1`` | ``nvfp4``, ``nvfp4_ascend`` | the weight-only variant (an ``input_scale`` needs calibration), and per merged module the UE8M0 exponents span at most 17 (checked on the data) | codes as stored (the same E2M1 table and nibble order); each UE8M0 scale ``2^(e − 127)`` of 32 inputs becomes two E4M3 block scales ``2^(e − 127 − G)`` and ``weight_scale_2 = 2^G`` with ``G = e_max − 127 − 8``, so the largest block scale is 2^8 and every one lies in E4M3's exact powers of two 2^-9 .. 2^8 (``e_max − e_min ≤ 17``); ``nvfp4_ascend`` then tiles them (``to_tiled``). No value is re-rounded: dequantization is bit-identical |

``fits(stored, target, others)`` (optional) checks the data: None, or why these values do not fit
(the converter then re-quantizes under ``--requantize`` and refuses otherwise, naming the tensor);
``repack(stored, target, others)`` carries them over. ``others`` are the stored tensors of the
other members of the weight's merged module (a gated MLP's gate and up, per routed expert:
``Job.amax_group``), which share the per-tensor scale; vLLM keeps one ``weight_scale_2`` per
merged module (``formats/nvfp4.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._lazy import torch
from .base import all_finite
from .dtypes import torch_dtype
from .errors import HetquantError
from .fp4_e2m1 import UE8M0_BIAS, check_ue8m0
from .nvfp4_ascend import to_tiled

Others = Sequence[Mapping[str, "torch.Tensor"]]  # the merged module's other members' tensors
E4M3_POW2 = (-9, 8)  # the powers of two an E4M3 (fn) scale holds exactly: 2^-9 (subnormal) .. 2^8

__all__ = ["E4M3_POW2", "LINEAR_REPACKS", "LinearRepack", "Others"]


@dataclass(frozen=True)
class LinearRepack:
    """``holds(source variant, target variant)`` → None or the reason the codes do not fit;
    ``repack(source stored tensors, target variant, others)`` → the target's stored tensors;
    ``fits(the same)`` → None or why these values do not fit (module docstring)."""

    holds: Callable[[Any, Any], str | None]
    repack: Callable[[Mapping[str, torch.Tensor], Any, Others], dict[str, torch.Tensor]]
    fits: Callable[[Mapping[str, torch.Tensor], Any, Others], str | None] | None = None


def _ct_holds(src: Any, dst: Any) -> str | None:
    if (src.group_size, src.scale_dtype) == (dst.group_size, dst.scale_dtype):
        return None
    return (
        f"the source's group {src.group_size} with {src.scale_dtype} scales does not fit "
        f"group {dst.group_size} with {dst.scale_dtype} scales"
    )


def _ct_repack(
    stored: Mapping[str, torch.Tensor], dst: Any, others: Others = ()
) -> dict[str, torch.Tensor]:
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


def _nvfp4_holds(src: Any, dst: Any) -> str | None:
    if dst.with_input_scale:
        return f"{dst.name} with input_scale needs a calibrated activation scale"
    return None


def _exponents(stored: Mapping[str, torch.Tensor], others: Others) -> tuple[int, int]:
    """(min, max) UE8M0 exponent byte over the weight and its merged module's other members."""
    check_ue8m0("scale", stored["scale"])
    spans = [t["scale"].view(torch.uint8) for t in (stored, *others) if t["scale"].numel()]
    if not spans:
        raise HetquantError("fp4_e2m1 → nvfp4: an empty weight has no scale to carry over")
    return min(int(t.min()) for t in spans), max(int(t.max()) for t in spans)


def _nvfp4_fits(stored: Mapping[str, torch.Tensor], dst: Any, others: Others = ()) -> str | None:
    lo, hi = E4M3_POW2
    e_min, e_max = _exponents(stored, others)
    if e_max - e_min <= hi - lo:
        return None
    return (
        f"its UE8M0 scale exponents span 2^{e_min - UE8M0_BIAS} .. 2^{e_max - UE8M0_BIAS} "
        f"({e_max - e_min + 1} powers of two{' over its merged module' * bool(others)}); an "
        f"NVFP4 E4M3 block scale holds {hi - lo + 1} (2^{lo} .. 2^{hi} times one global scale), "
        "so its FP4 codes cannot be kept as they are; --requantize re-quantizes them"
    )


def _nvfp4_from_fp4(
    stored: Mapping[str, torch.Tensor], dst: Any, others: Others = ()
) -> dict[str, torch.Tensor]:
    """DeepSeek-V4's E2M1 + UE8M0 per 32 → NVFP4 (module table), exactly."""
    why = _nvfp4_fits(stored, dst, others)
    if why is not None:
        raise HetquantError(why)
    hi = E4M3_POW2[1]
    g = _exponents(stored, others)[1] - UE8M0_BIAS - hi  # weight_scale_2 = 2^g
    e = stored["scale"].view(torch.uint8).to(torch.int32)  # (N, K/32)
    block = torch.ldexp(torch.ones(e.shape, dtype=torch.float32), e - UE8M0_BIAS - g)
    canonical = {
        "weight": stored["weight"].contiguous().view(torch.uint8),  # the same codes and nibbles
        "weight_scale": block.repeat_interleave(2, dim=1).to(torch.float8_e4m3fn),  # exact
        "weight_scale_2": torch.ldexp(torch.tensor(1.0), torch.tensor(g)).to(torch.float32),
    }
    return canonical if dst.name == "nvfp4" else to_tiled(canonical)


LINEAR_REPACKS: dict[tuple[str, str], LinearRepack] = {
    ("ct_pack_quantized", "ct_pack_quantized"): LinearRepack(_ct_holds, _ct_repack),
    ("fp4_e2m1", "nvfp4"): LinearRepack(_nvfp4_holds, _nvfp4_from_fp4, _nvfp4_fits),
    ("fp4_e2m1", "nvfp4_ascend"): LinearRepack(_nvfp4_holds, _nvfp4_from_fp4, _nvfp4_fits),
}
