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

The arithmetic (E4M3 decode, row dequantization, absmax from the codes, the source checks) lives
in ``formats/fp8_block_rows.py``; this module holds the registered format and re-exports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ._lazy import torch
from ._rows_native import fp8_absmax_array, fp8_dequant_rows, fp8_dequant_rows_array
from .arrays import RowsInto, native
from .base import TensorMeta, WeightFormat, register
from .errors import HetquantError
from .fp8_block_rows import (
    FP8_E4M3_MAX,
    SCALE_FMTS,
    absmax_dequantized,
    check_codes,
    check_pow2_scales,
    check_scales,
    dequantize_rows,
    e4m3_to_f32,
    scale_shape,
)

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

DEVICE_CHUNK = 16 << 20  # codes dequantized at once off the CPU (~16 bytes of temporaries each)


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
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int],
        into: RowsInto | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:  # fmt: skip
        """:meth:`source_rows` on numpy arrays (``arrays``): BF16 bits, by the kernel alone,
        each block row dequantized into ``into``'s array where it gives one."""
        w, s = arrays["weight"], arrays["weight_scale_inv"]
        self._check_scales(f"{name}.weight_scale_inv", s)
        for r in range(0, shape[0], self.block):
            codes = w[r : r + self.block]  # [n <= block, in]
            out = into(r, codes.shape[0]) if into is not None else None
            rows = fp8_dequant_rows_array(codes, s[r // self.block], self.block, out=out)
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
        """:meth:`source_absmax` on numpy arrays, by the kernel alone, which reads only the
        blocks that can hold it (NotNative on a NaN code there: the torch code then names it;
        one elsewhere is refused by :meth:`source_row_arrays`, which reads every code)."""
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
