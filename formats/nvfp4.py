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
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import _quant_native
from ._lazy import torch
from .arrays import NotNative, native
from .base import Streaming, TensorMeta, WeightFormat, register
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .errors import HetquantError

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

BLOCK = 16  # inputs per E4M3 block scale
FP8_E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E2M1_MAX = 6.0
# Value of each 4-bit code: index = sign << 3 | magnitude index (ModelOpt ``e2m1_values``).
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: tuple[float, ...] = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)
# Midpoints between neighbouring magnitudes; at these the tie goes to the even code.
E2M1_BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose even neighbour is the larger one

_SCALAR: tuple[int, ...] = ()
try:
    _HETQUANT_VERSION = importlib.metadata.version("hetquant")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    _HETQUANT_VERSION = "0+unknown"


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise HetquantError(
            f"nvfp4: in_features {k} is not a multiple of the block size {BLOCK}; NVFP4 cannot "
            "store this weight — keep it in another format (e.g. bf16)"
        )


def _check_2d(weight: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise HetquantError(f"nvfp4.quantize: expected a 2-D weight, got {tuple(weight.shape)}")
    _check_k(weight.shape[1])


def _scale_2_from_amax(amax: torch.Tensor) -> torch.Tensor:
    s2 = amax.to(torch.float32) / (E2M1_MAX * FP8_E4M3_MAX)
    return torch.where(s2 > 0, s2, torch.ones_like(s2))


def _scale_2_value(amax: float) -> np.float32:
    """:func:`_scale_2_from_amax` of a Python float by numpy scalars (one per streamed row
    block: torch's ops cost ~0.4 ms each time): the same float32 rounding of ``amax`` and the
    same float32 division, so the same value."""
    s2 = np.float32(amax) / np.float32(E2M1_MAX * FP8_E4M3_MAX)
    return s2 if s2 > 0 else np.float32(1.0)


def _scale_2_of(amax: float) -> torch.Tensor:
    """:func:`_scale_2_value` as a 0-d float32 tensor."""
    return torch.tensor(_scale_2_value(amax), dtype=torch.float32)


def _block_scales_from_amax(amax: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    sb = amax / (E2M1_MAX * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    return sb.clamp(E4M3_MIN_SUBNORMAL, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round f32 ``y`` to the nearest E2M1 value (ties to even, saturating): uint8 codes 0..15."""
    return _e2m1_codes(y.abs(), y < 0)


def _e2m1_codes(mag: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Codes from magnitudes and signs. The magnitude code is the number of decision bounds
    ``mag`` passes; at a bound (a tie) the even code wins: bounds below an even code count when
    reached (``>=``, the ``_TIES_UP``), the others only when passed (``>``)."""
    idx = torch.zeros(mag.shape, dtype=torch.uint8)
    for bound in E2M1_BOUNDS:
        idx += (mag >= bound) if bound in _TIES_UP else (mag > bound)
    return (negative.to(torch.uint8) << 3) | idx


def _effective_scale(weight_scale: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """f32(sb) * s2 in f32, [N, K/16]: the step of each block's grid."""
    return weight_scale.to(torch.float32) * s2.to(torch.float32)


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
        _check_k(k)
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
        _check_2d(weight)
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
        return _scale_2_value(amax)

    def _quantize_native(self, weight: torch.Tensor, given: Any) -> dict[str, torch.Tensor] | None:
        """:meth:`_quantize_torch` by the kernel; None where it does not apply or on NaN/Inf
        (then the torch path raises)."""
        if given is None:
            amax = _quant_native.absmax(weight)
            if amax is None or not math.isfinite(amax):
                return None
            s2 = _scale_2_of(amax)
        else:
            s2 = _scale_2_of(float(given))
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
        s2 = _scale_2_from_amax(amax if given is None else torch.as_tensor(float(given)))
        sb = _block_scales_from_amax(block_amax, s2)
        y_mag = mag / _effective_scale(sb, s2)[..., None]  # (N, K/16, 16), |w| / step
        codes = _e2m1_codes(y_mag.reshape(n, k), w < 0)  # (N, K)
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
        eff = _effective_scale(tensors["weight_scale"], tensors["weight_scale_2"])
        return (values * eff[..., None]).reshape(n, k)


def hf_quant_config(
    exclude_modules: Iterable[str],
    *,
    with_input_scale: bool = False,
    kv_cache_quant_algo: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """ModelOpt's ``hf_quant_config.json`` and the ``quantization_config`` for config.json.

    Args:
        exclude_modules: module names or glob patterns kept unquantized (``lm_head``, ...);
            written sorted and de-duplicated so artifacts are byte-identical.
        with_input_scale: the format variant's flag. True → ``quant_algo: NVFP4`` (W4A4, as
            ``nvidia/DeepSeek-R1-FP4``; needs ``input_scale``). False → ``W4A16_NVFP4``,
            ModelOpt's weight-only name (``convert_hf_config.py``), so that a W4A4 engine
            refuses the artifact instead of running with a missing ``input_scale``.
        kv_cache_quant_algo: ``None`` (KV cache unquantized) or e.g. ``"FP8"``.

    Returns:
        ``(hf_quant_config, quantization_config)``. The first has the keys of fp4.md §2.1
        (``producer``; ``quantization``: ``quant_algo``, ``kv_cache_quant_algo``,
        ``group_size``, ``exclude_modules``). The second is the same dict plus
        ``"quant_method": "modelopt"``: vLLM's ModelOpt config reads this nested
        ``quantization`` form from config.json as well as from hf_quant_config.json.
    """
    if isinstance(exclude_modules, str):
        raise HetquantError("hf_quant_config: exclude_modules must be a list of names, not a str")
    quantization = {
        "quant_algo": "NVFP4" if with_input_scale else "W4A16_NVFP4",
        "kv_cache_quant_algo": kv_cache_quant_algo,
        "group_size": BLOCK,
        "exclude_modules": sorted(set(exclude_modules)),
    }
    hf = {
        "producer": {"name": "hetquant", "version": _HETQUANT_VERSION},
        "quantization": quantization,
    }
    return hf, {"quant_method": "modelopt", **copy.deepcopy(hf)}


register(Nvfp4())
