"""NVIDIA ModelOpt NVFP4: E2M1 weights, one E4M3 scale per 16 inputs, one F32 scale per tensor.

Stored tensors for a linear weight ``W`` of shape [N, K] = [out, in] (local names, as ModelOpt
exports them and vLLM's ``ModelOptNvFp4LinearMethod`` and chitu's ``blockfp4`` load them):

==================  =========  ==========  ====================================================
name                dtype      shape       meaning
==================  =========  ==========  ====================================================
``weight``          U8         [N, K/2]    E2M1 codes; byte j of row n holds k = 2j in the low
                                           nibble (bits 0-3) and k = 2j+1 in the high nibble
``weight_scale``    F8_E4M3    [N, K/16]   block scale of inputs 16b .. 16b+15 of row n
``weight_scale_2``  F32        []          per-tensor scale, a 0-d scalar
``input_scale``     F32        []          only when ``with_input_scale``: act_amax / (6 * 448)
==================  =========  ==========  ====================================================

A code is ``sign << 3 | i`` with ``E2M1_VALUES[i]`` in {0, 0.5, 1, 1.5, 2, 3, 4, 6}; 0b1000 is -0.

Dequantization (ModelOpt ``NVFP4QTensor.dequantize``), in float32::

    W'[n, k] = E2M1_VALUES[code[n, k]] * (f32(weight_scale[n, k // 16]) * weight_scale_2)

Quantization (ModelOpt ``nvfp4_tensor.py``, stored commit 211c6b3; reference/fp4.md §2.2)::

    s2   = amax|W| / (6 * 448)                                   # f32
    sb   = amax_16|W_block| / (6 * s2);  sb = 1 where sb == 0
    sb   = e4m3(clamp(sb, 2**-9, 448))                           # round to nearest even
    code = sign(W) << 3 | rne_e2m1(|W| / (f32(sb) * s2))         # saturates at 6

``rne_e2m1`` rounds to the nearest E2M1 magnitude, ties to the even code (0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Negative values that round to 0 keep the sign
(code 0b1000), as ModelOpt's ``_cast_fp4`` does. Where we differ from ModelOpt: K not divisible by
16 is refused (ModelOpt pads), an all-zero weight gets ``s2 = 1`` (ModelOpt divides 0 by 0), and
NaN/Inf weights are refused.

Merged modules share ``s2``: linears an engine runs as one GEMM (a gated MLP's gate and up, per
routed expert too) get ``s2`` from their joint ``amax``, as ModelOpt's export writes them
(``modelopt/torch/export/quant_utils.py:1490-1562``) and vLLM loads them (one value per merged
module); ``quantize(weight_amax=...)`` takes it and ``convert/planning/plan.py`` groups the members.

``input_scale`` is the global scale of the *activations* for W4A4 on Blackwell (GEMM alpha =
input_scale * weight_scale_2). It needs calibration (``act_amax``) and is unused on Ascend, where
activations stay BF16 (fp4.md §1.4, §2.2). So the default variant is weight-only (W4A16) and
stores none; ``get_format("nvfp4", with_input_scale=True)`` adds it.
The arithmetic (code and scale tables, scales, E2M1 rounding) lives in ``formats/nvfp4_codes.py``
and ModelOpt's config files in ``formats/nvfp4_config.py``; this module holds the registered format
and re-exports both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import _quant_native
from ._lazy import torch
from .arrays import NotNative, native
from .base import Streaming, TensorMeta, WeightFormat, register
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .errors import HetquantError
from .nvfp4_codes import (
    BLOCK,
    E2M1_BOUNDS,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MIN_SUBNORMAL,
    FP8_E4M3_MAX,
    block_scales_from_amax,
    check_2d,
    check_k,
    e2m1_codes,
    effective_scale,
    magnitude_codes,
    scale_2_from_amax,
    scale_2_of,
    scale_2_value,
)
from .nvfp4_config import hf_quant_config

__all__ = [
    "BLOCK",
    "E2M1_BOUNDS",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MIN_SUBNORMAL",
    "FP8_E4M3_MAX",
    "Nvfp4",
    "e2m1_codes",
    "hf_quant_config",
]

_SCALAR: tuple[int, ...] = ()


@dataclass(frozen=True)
class Nvfp4(WeightFormat):
    """ModelOpt NVFP4 weight (see the module docstring); W4A16 unless ``with_input_scale``."""

    name: ClassVar[str] = "nvfp4"
    native_quantize: ClassVar[bool] = True  # quantize_array
    _K_MAJOR: ClassVar[bool] = False  # the kernel's output layout; see nvfp4_ascend._KMajorChunks
    keys: ClassVar[frozenset[str]] = frozenset({"weight", "weight_scale", "weight_scale_2"})
    optional_keys: ClassVar[frozenset[str]] = frozenset({"input_scale"})
    with_input_scale: bool = False

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Nvfp4, tuple[int, int]]:
        n, half = metas["weight"].shape  # [N, K/2]: two E2M1 codes per byte
        return dataclasses.replace(self, with_input_scale="input_scale" in metas), (n, 2 * half)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        axes: dict[str, int | None] = {"weight": 0, "weight_scale": 0, "weight_scale_2": None}
        if self.with_input_scale:
            axes["input_scale"] = None
        return Streaming(self, axes, needs_amax=True)

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        axes: dict[str, tuple[int | None, int | None]] = {
            "weight": (0, 1),  # 2 inputs per byte
            "weight_scale": (0, 1),  # BLOCK inputs per scale
            "weight_scale_2": (None, None),
        }
        if self.with_input_scale:
            axes["input_scale"] = (None, None)
        return axes

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = shape
        check_k(k)
        out = {
            "weight": TensorMeta("U8", (n, k // 2)),
            "weight_scale": TensorMeta("F8_E4M3", (n, k // BLOCK)),
            "weight_scale_2": TensorMeta("F32", _SCALAR),
        }
        if self.with_input_scale:
            out["input_scale"] = TensorMeta("F32", _SCALAR)
        return out

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        """Quantize ``weight`` [N, K]; option ``act_amax`` (calibrated) iff ``with_input_scale``.

        ``weight_amax``: the absmax of the whole weight when ``weight`` is a block of its rows
        (streaming); the global scale comes from it instead of from ``weight``. BF16/F32 rows
        on the CPU go through the fused C++ kernel (``_quant_native``), others through torch;
        both give the same bytes.
        """
        check_2d(weight)
        given = options.get("weight_amax")
        out = self._quantize_native(weight, given)
        if out is None:
            out = self._quantize_torch(weight, given)
        out.update(self._input_scale(options.get("act_amax")))
        return out

    def quantize_array(self, rows: np.ndarray, **options: Any) -> dict[str, np.ndarray]:
        """:meth:`quantize` of BF16/F32 rows (numpy, BF16 as its bits) by the kernel, without
        torch; ``weight_amax`` as there. NotNative for ``act_amax`` (the calibrated variant),
        NaN/Inf, or rows the kernel does not take."""
        layout = "kmajor" if self._K_MAJOR else "rows"
        s2 = self._array_scale_2(rows, options)
        got = native(_quant_native.nvfp4_array(rows, float(s2), layout), f"{self.name}: rows")
        return {"weight": got[0], "weight_scale": got[1], "weight_scale_2": np.array(s2)}

    def _array_scale_2(self, rows: np.ndarray, options: Mapping[str, Any]) -> np.float32:
        """``weight_scale_2`` of :meth:`quantize_array` (from ``weight_amax`` or ``rows``)."""
        if self.with_input_scale or set(options) - {"weight_amax"}:
            raise NotNative(f"{self.name}: options {sorted(options)} need the torch code")
        amax = options.get("weight_amax")
        if amax is None:
            amax = native(_quant_native.absmax_array(rows), f"{self.name}: no absmax kernel")
        if not math.isfinite(amax):
            raise NotNative(f"{self.name}: NaN/Inf")  # the torch code names it
        return scale_2_value(amax)

    def _quantize_native(self, weight: torch.Tensor, given: Any) -> dict[str, torch.Tensor] | None:
        """:meth:`_quantize_torch` by the kernel; None where it does not apply or on NaN/Inf
        (then the torch path raises)."""
        if given is None:
            amax = _quant_native.absmax(weight)
            if amax is None or not math.isfinite(amax):
                return None
            s2 = scale_2_of(amax)
        else:
            s2 = scale_2_of(float(given))
        packed = _quant_native.nvfp4(weight, float(s2), self._K_MAJOR)
        if packed is None:
            return None
        return {"weight": packed[0], "weight_scale": packed[1], "weight_scale_2": s2}

    def _quantize_torch(self, weight: torch.Tensor, given: Any) -> dict[str, torch.Tensor]:
        """The reference: weight, weight_scale, weight_scale_2 of ``weight`` [N, K]."""
        w = weight.to(torch.float32)
        n, k = w.shape
        mag = w.abs().reshape(n, k // BLOCK, BLOCK)  # (N, K/16, 16), one pass serves all below
        block_amax = mag.amax(dim=-1)  # (N, K/16)
        amax = block_amax.amax()
        if not bool(torch.isfinite(amax)):  # NaN and Inf propagate through the max
            raise HetquantError("nvfp4.quantize: weight contains NaN or Inf; the source is corrupt")
        s2 = scale_2_from_amax(amax if given is None else torch.as_tensor(float(given)))
        sb = block_scales_from_amax(block_amax, s2)
        y_mag = mag / effective_scale(sb, s2)[..., None]  # (N, K/16, 16), |w| / step
        codes = magnitude_codes(y_mag.reshape(n, k), w < 0)  # (N, K)
        return {"weight": self._pack(codes), "weight_scale": sb, "weight_scale_2": s2}

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return pack_nibbles_u8(codes)

    def _input_scale(self, act_amax: float | None) -> dict[str, torch.Tensor]:
        if not self.with_input_scale:
            if act_amax is not None:
                raise HetquantError("nvfp4: act_amax given but with_input_scale is False")
            return {}
        if act_amax is None or not (0 < float(act_amax) < float("inf")):
            raise HetquantError(
                f"nvfp4 with input_scale needs a calibrated act_amax > 0, got {act_amax!r}; "
                "run calibration or use the weight-only variant"
            )
        amax = torch.tensor(float(act_amax), dtype=torch.float32)
        return {"input_scale": amax / (E2M1_MAX * FP8_E4M3_MAX)}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight = tensors["weight"]
        n, k = weight.shape[0], 2 * weight.shape[1]
        self.check_stored(tensors, (n, k))
        codes = unpack_nibbles_u8(weight).long()  # (N, K)
        values = torch.tensor(E2M1_VALUES)[codes].reshape(n, k // BLOCK, BLOCK)
        eff = effective_scale(tensors["weight_scale"], tensors["weight_scale_2"])
        return (values * eff[..., None]).reshape(n, k)


register(Nvfp4())
