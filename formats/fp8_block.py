"""DeepSeek-V3's FP8 block format — the source format of every conversion.

Stored tensors for a linear weight of shape [out, in] (names relative to the module prefix):

=====================  =========  ============================================  ==============
name                   dtype      shape                                         meaning
=====================  =========  ============================================  ==============
``weight``             F8_E4M3    [out, in]                                     E4M3 codes
``weight_scale_inv``   F32        [ceil(out / 128), ceil(in / 128)]             block multiplier
=====================  =========  ============================================  ==============

Despite its name, ``weight_scale_inv`` is a *multiplier* (DeepSeek ``inference/kernel.py``,
``weight_dequant``; README_WEIGHTS.md). Dequantization, bit-exact against DeepSeek's formula::

    W[m, n] = bf16( f32(weight[m, n]) * weight_scale_inv[m // 128, n // 128] )  # RNE

Edge blocks that do not fill 128×128 (``kv_a_proj_with_mqa``: 576 rows → 4.5 blocks) use the scale
of the block that contains them.

Read as a source (``source_rows``), a weight is refused when a code is NaN (E4M3FN has no
infinities), or a scale is NaN, infinite, negative, or so large that ``448 · s`` overflows BF16.

``scale_fmt``: ``float`` (V3 / R1: any F32 scale) or ``ue8m0`` (DeepSeek-V3.1's
``quantization_config.scale_fmt``: every scale a power of two, still stored as F32
``weight_scale_inv``; dequantization is unchanged). Under ``ue8m0`` a scale that is not a power of
two is a corrupt source. Quantization (used to build test checkpoints exactly as DeepSeek
ships them): per 128×128 block, ``s = amax / 448`` (``s = 1`` for an all-zero block) and
``weight = e4m3(W / s)``, saturating at ±448.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import _quant_native
from ._lazy import torch
from ._rows_native import fp8_absmax_array, fp8_dequant_rows, fp8_dequant_rows_array
from .arrays import native
from .base import TensorMeta, WeightFormat, register
from .errors import HetquantError

__all__ = [
    "FP8_E4M3_MAX",
    "Fp8Block",
    "absmax_dequantized",
    "check_codes",
    "check_pow2_scales",
    "check_scales",
    "dequantize_rows",
    "e4m3_to_f32",
    "scale_shape",
]

FP8_E4M3_MAX = 448.0
DEVICE_CHUNK = 16 << 20  # codes dequantized at once off the CPU (~16 bytes of temporaries each)


def scale_shape(shape: tuple[int, int], block: int) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape`` and square ``block``."""
    return (-(-shape[0] // block), -(-shape[1] // block))


def dequantize_rows(
    weight: torch.Tensor, scale_inv: torch.Tensor, row0: int, block: int = 128
) -> torch.Tensor:
    """Dequantize rows ``row0 : row0 + len(weight)`` of a block-FP8 weight to BF16, bit-exactly.

    ``weight`` is a row slice [r, in] (E4M3) that lies inside ONE block row (``row0 // block ==
    (row0 + r - 1) // block``); ``scale_inv`` is the full [ceil(out/b), ceil(in/b)] F32 scale.
    Streaming callers use this to keep memory at one block row.
    """
    rows, cols = weight.shape
    brow = row0 // block
    if (row0 + rows - 1) // block != brow:
        raise HetquantError(f"dequantize_rows: rows {row0}..{row0 + rows} cross a block row")
    s_row = scale_inv[brow].repeat_interleave(block)[:cols]  # (in,)
    return (e4m3_to_f32(weight) * s_row).to(torch.bfloat16)  # (r, in)


_E4M3_MAGNITUDE = 0x7F  # low 7 bits; also E4M3FN's NaN magnitude (S.1111.111)
_BF16_MAX = (2 - 2**-7) * 2.0**127  # torch.finfo(torch.bfloat16).max


def check_codes(name: str, codes: torch.Tensor) -> None:
    """Refuse NaN codes. E4M3FN's only NaNs are 0x7F and 0xFF: the largest int8 and the largest
    uint8 values, so two max reductions find them (far cheaper than masking every byte)."""
    if codes.numel() and (
        int(codes.view(torch.int8).max()) == _E4M3_MAGNITUDE
        or int(codes.view(torch.uint8).max()) == 0xFF
    ):
        raise HetquantError(f"{name}: NaN code(s) in the FP8 weight; the checkpoint is corrupt")


SCALE_FMTS = ("float", "ue8m0")
_F32_MANTISSA = (1 << 23) - 1


def _host_f32(scale_inv: Any) -> np.ndarray:
    """Scales (a numpy array, or a tensor on any device) as a float32 numpy array: the checks
    below are one rule for the torch code and the native lane (``arrays``)."""
    if isinstance(scale_inv, np.ndarray):
        return scale_inv.astype(np.float32, copy=False)
    return scale_inv.detach().to("cpu", torch.float32).numpy()


def check_pow2_scales(name: str, scale_inv: Any) -> None:
    """Refuse a scale that is not a power of two (UE8M0: exponent only; zero mantissa bits,
    normal numbers, positive). ``scale_inv``: a numpy array or a tensor."""
    s = np.ascontiguousarray(_host_f32(scale_inv)).reshape(-1)
    bits = s.view(np.int32)
    bad = ((bits & _F32_MANTISSA) != 0) | (bits <= _F32_MANTISSA)  # mantissa, or ≤ 0 / subnormal
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise HetquantError(
            f"{name}: scale {float(s[i])!r} (entry {i}) is not a power of two, but config.json "
            "declares scale_fmt ue8m0; the checkpoint is corrupt or its config is not its own"
        )


def check_scales(name: str, scale_inv: Any) -> None:
    """Refuse NaN/Inf, negative scales, and scales whose largest code (448) overflows BF16.
    ``scale_inv``: a numpy array or a tensor."""
    s = _host_f32(scale_inv)
    lo, hi = (float(s.min()), float(s.max())) if s.size else (0.0, 0.0)  # NaN propagates
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int((~np.isfinite(s)).sum())
        raise HetquantError(f"{name}: {bad} NaN/Inf value(s) of {s.size}; corrupt scale")
    if lo < 0:
        raise HetquantError(
            f"{name}: negative scale {lo:g}; block scales are positive, the checkpoint is corrupt"
        )
    if hi * FP8_E4M3_MAX > _BF16_MAX:
        raise HetquantError(
            f"{name}: scale {hi:g} makes 448·s overflow BF16; the checkpoint is corrupt"
        )


def absmax_dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> float:
    """``max |dequantize_rows(weight)|`` over a whole block-FP8 weight, without dequantizing it.

    |bf16(f32(c)·s)| is non-decreasing in |c| (multiplication by one scale and rounding are
    monotonic), and E4M3 magnitudes order like the integers of their low 7 bits, so in each
    block row only every column's largest code needs dequantizing: one byte-wise max per block
    row (the C++ column max where built), then ``in`` values per block row instead of
    ``block × in``, all block rows in one go. NaN codes raise.
    """
    codes = weight.view(torch.uint8)
    blocks = -(-codes.shape[0] // block)
    mags = torch.empty((blocks, codes.shape[1]), dtype=torch.uint8)  # (out/b, in)
    for b in range(blocks):
        rows = codes[b * block : (b + 1) * block]
        got = _quant_native.u8_colmax7(rows)
        mags[b] = got if got is not None else (rows & _E4M3_MAGNITUDE).amax(dim=0)
    if mags.numel() == 0:
        return 0.0
    if int(mags.amax()) == _E4M3_MAGNITUDE:
        raise HetquantError("NaN code(s) in the FP8 weight; the checkpoint is corrupt")
    s = scale_inv[:blocks].repeat_interleave(block, dim=1)[:, : codes.shape[1]]  # (out/b, in)
    return float((e4m3_to_f32(mags.view(torch.float8_e4m3fn)) * s).to(torch.bfloat16).abs().amax())


_F32_SIGN_EXP4_MAN3 = -2014314496  # 0x87F00000 as int32: sign, low 4 exponent bits, top 3 mantissa
_E4M3_REBIAS = 2.0**120  # 2^(127 - 7): float32 exponent bias minus E4M3's


def e4m3_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 (float8_e4m3fn) → float32, exactly, by integer ops (torch's own cast is ~10× slower).

    The byte ``s eeee mmm`` sign-extended to int32 and shifted left by 20 puts ``eeee mmm`` at
    float32 bits 20..26 and the sign at bit 31; as a float32 that is ``±2^(eeee−127)·1.mmm``
    (a float32 subnormal when ``eeee = 0``, exactly like E4M3's subnormals), and one multiply by
    2^120 — exact, a power of two — gives the E4M3 value. NaN codes must be refused before.
    """
    bits = codes.view(torch.int8).to(torch.int32)  # sign-extended
    bits = (bits << 20) & _F32_SIGN_EXP4_MAN3
    return bits.view(torch.float32) * _E4M3_REBIAS


@dataclass(frozen=True)
class Fp8Block(WeightFormat):
    """E4M3 weight + F32 per-block multiplier (see module docstring)."""

    name: ClassVar[str] = "fp8_block"
    native_source: ClassVar[bool] = True  # source_row_arrays
    keys: ClassVar[frozenset[str]] = frozenset({"weight", "weight_scale_inv"})
    block: int = 128
    scale_fmt: str = "float"  # or "ue8m0": powers of two (see the module docstring)

    def __post_init__(self) -> None:
        if self.scale_fmt not in SCALE_FMTS:
            raise HetquantError(
                f"fp8_block: scale_fmt {self.scale_fmt!r} is not one of {list(SCALE_FMTS)}"
            )

    def _check_scales(self, name: str, scale_inv: Any) -> None:
        check_scales(name, scale_inv)
        if self.scale_fmt == "ue8m0":
            check_pow2_scales(name, scale_inv)

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Fp8Block, tuple[int, int]]:
        """The block edge that gives the scale grid. A grid of ceil-divided blocks does not pin
        the edge down (160 rows in 3 blocks: any edge from 54 to 79), so this variant's edge is
        tried first, then powers of two, then the edges the grid implies."""
        n, k = metas["weight"].shape
        grid = metas["weight_scale_inv"].shape
        powers = [1 << p for p in range(4, 11)]
        for block in (self.block, *powers, -(-n // grid[0]), -(-k // grid[1])):
            if scale_shape((n, k), block) == tuple(grid):
                return dataclasses.replace(self, block=block), (n, k)
        raise HetquantError(f"scale grid {list(grid)} fits no square block of weight {[n, k]}")

    def source_rows(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """One block row at a time, validated (see the module docstring)."""
        w, s = tensors["weight"], tensors["weight_scale_inv"]
        self._check_scales(f"{name}.weight_scale_inv", s)
        for r in range(0, shape[0], self.block):
            yield r, self._block_row(f"{name}.weight", w[r : r + self.block], s, r)

    def source_row_arrays(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int]
    ) -> Iterator[tuple[int, np.ndarray]]:
        """:meth:`source_rows` on numpy arrays (``arrays``): BF16 bits, by the kernel alone."""
        w, s = arrays["weight"], arrays["weight_scale_inv"]
        self._check_scales(f"{name}.weight_scale_inv", s)
        for r in range(0, shape[0], self.block):
            rows = fp8_dequant_rows_array(w[r : r + self.block], s[r // self.block], self.block)
            yield r, native(rows, f"{name}.weight: FP8 rows {r}+")

    def _block_row(
        self, name: str, rows: torch.Tensor, scale_inv: torch.Tensor, row0: int
    ) -> torch.Tensor:
        """Rows of one block row, NaN codes refused, dequantized: the fused kernel where it
        applies (``_rows_native``), else the torch code (whose check raises on a NaN code)."""
        out = fp8_dequant_rows(rows, scale_inv[row0 // self.block], self.block)
        if out is None:
            check_codes(name, rows)
            out = dequantize_rows(rows, scale_inv, row0, self.block)
        return out

    def source_dequantized(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> torch.Tensor:
        """The whole weight as BF16, validated, on the device ``tensors`` are on. On the CPU one
        block row at a time (:meth:`source_rows`); elsewhere (a calibration that copied the FP8
        bytes to its accelerator) the same torch arithmetic there, bit-identical — the integer
        E4M3 decode, one float32 multiply, the RNE cast — in chunks of ``DEVICE_CHUNK`` codes,
        with one NaN-code check for the whole weight."""
        if tensors["weight"].device.type == "cpu":
            return super().source_dequantized(name, tensors, shape)
        return self.dequantized_in_chunks(name, tensors["weight"], tensors["weight_scale_inv"])

    def dequantized_in_chunks(
        self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`source_dequantized` with torch ops on ``weight``'s device (any device)."""
        self._check_scales(f"{name}.weight_scale_inv", scale_inv)
        check_codes(f"{name}.weight", weight)
        self.check_scale(f"{name}.weight", tuple(weight.shape), tuple(scale_inv.shape))
        n, k = weight.shape
        out = torch.empty((n, k), dtype=torch.bfloat16, device=weight.device)
        b = self.block
        step = b * max(1, DEVICE_CHUNK // max(1, b * k))  # whole block rows
        for r in range(0, n, step):
            rows = weight[r : r + step]  # (≤ step, in)
            scales = scale_inv[r // b : -(-(r + rows.shape[0]) // b)]  # their block rows
            out[r : r + rows.shape[0]] = self.dequantize_bf16(rows, scales)
        return out

    def source_absmax(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> float:
        """From the codes (``absmax_dequantized``), without dequantizing the weight."""
        self._check_scales(f"{name}.weight_scale_inv", tensors["weight_scale_inv"])
        try:
            return absmax_dequantized(tensors["weight"], tensors["weight_scale_inv"], self.block)
        except HetquantError as e:
            raise HetquantError(f"{name}.weight: {e}") from None

    def source_absmax_array(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int]
    ) -> float:
        """:meth:`source_absmax` on numpy arrays, by the kernel alone (NotNative on NaN codes:
        the torch code then names them)."""
        s = arrays["weight_scale_inv"]
        self._check_scales(f"{name}.weight_scale_inv", s)
        got = fp8_absmax_array(arrays["weight"], s, self.block)
        return native(got, f"{name}.weight: FP8 absmax")

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        return {
            "weight": TensorMeta("F8_E4M3", tuple(shape)),
            "weight_scale_inv": TensorMeta("F32", scale_shape(shape, self.block)),
        }

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        # A scale covers block x block weights; dims padded to whole blocks cannot be split.
        return {"weight": (0, 1), "weight_scale_inv": (0, 1)}

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        if weight.ndim != 2:
            raise HetquantError(
                f"fp8_block.quantize: expected a 2-D weight, got {tuple(weight.shape)}"
            )
        out, inp = weight.shape
        b = self.block
        sr, sc = scale_shape((out, inp), b)
        w = torch.zeros(sr * b, sc * b, dtype=torch.float32)  # zero-padded to whole blocks
        w[:out, :inp] = weight.to(torch.float32)
        blocks = w.reshape(sr, b, sc, b)  # (sr, b, sc, b)
        amax = blocks.abs().amax(dim=(1, 3))  # (sr, sc)
        s = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        q = (blocks / s[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        q = q.reshape(sr * b, sc * b)[:out, :inp].to(torch.float8_e4m3fn)  # (out, in)
        return {"weight": q.contiguous(), "weight_scale_inv": s.contiguous()}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.dequantize_bf16(tensors["weight"], tensors["weight_scale_inv"]).float()

    def dequantize_bf16(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """DeepSeek's exact dequantization: bf16(f32(x) * s[m // b, n // b])."""
        self.check_scale("weight", tuple(weight.shape), tuple(scale_inv.shape))
        s = scale_inv.to(torch.float32)
        s = s.repeat_interleave(self.block, 0)[: weight.shape[0]]  # (out, sc)
        s = s.repeat_interleave(self.block, 1)[:, : weight.shape[1]]  # (out, in)
        return (e4m3_to_f32(weight) * s).to(torch.bfloat16)

    def check_scale(self, name: str, wshape: tuple[int, ...], sshape: tuple[int, ...]) -> None:
        """Raise unless ``sshape`` is the scale shape for a weight of ``wshape``."""
        if len(wshape) != 2:
            raise HetquantError(f"{name}: FP8 block weight must be 2-D, got shape {list(wshape)}")
        want = scale_shape((wshape[0], wshape[1]), self.block)
        if tuple(sshape) != want:
            raise HetquantError(
                f"{name}_scale_inv has shape {list(sshape)}, expected {list(want)} for weight "
                f"{list(wshape)} with {self.block}x{self.block} blocks; the checkpoint is corrupt "
                "or not DeepSeek's block-FP8 format"
            )


register(Fp8Block())
