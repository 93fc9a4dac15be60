"""NVFP4 in chitu's Ascend layout (``Packed4BitWeightNPUNative``), for the cinfer_ascendc kernels.

Same codes and scales as :mod:`.nvfp4`, reordered. Stored tensors for ``W`` [N, K] = [out, in]:

==================  =========  ==========  ====================================================
name                dtype      shape       meaning
==================  =========  ==========  ====================================================
``weight``          U8         [K, N/2]    E2M1 codes packed along N (even n in the low nibble,
                                           odd n in the high nibble), bytes in tile order
``weight_scale``    F8_E4M3    [K/16, N]   the canonical block scales, transposed (K-major)
``weight_scale_2``  F32        []          unchanged
``input_scale``     F32        []          only when ``with_input_scale``; unchanged
==================  =========  ==========  ====================================================

Tile order (chitu ``native_layout/npu.py`` ``_repack_weight``; reference/fp4.md §1.5). Write
``k = 64*K3 + 16*K2 + 8*K1 + K0`` (K2 < 4, K1 < 2, K0 < 8) and the packed column
``n // 2 = 128*N3 + 16*N2 + 4*N1 + N0`` (N2 < 8, N1 < 4, N0 < 4). The bytes of the row-major
[K, N/2] matrix are stored in the order K3 > K1 > K2 > N2 > N3 > N1 > K0 > N0 (outermost first),
i.e. ``reshape(K/64, 4, 2, 8, N/256, 8, 4, 4).permute(0, 2, 1, 5, 4, 6, 3, 7)``. The innermost
K0 x N0 block is one 8(k) x 8(n) FP4 tile = 32 bytes, one Ascend UB data block. The stored
``weight`` is the buffer that chitu hands to ``cinfer_ascendc.grouped_gemm`` after
``reshape(1, K, N/2)`` (chitu's own parameter keeps the nominal shape [N, K/2], a FIXME there).
Shape rules (``_repack_weight`` assertions): ``K % 64 == 0`` and ``N % 256 == 0``.

Scales stay E4M3 + F32 so that :func:`to_canonical` is exact; :func:`npu_scale_bf16` folds them
at load time into the BF16 [K/16, N] scale the kernel takes (chitu ``anti_quant_fp8``).
Dequantization is that of :mod:`.nvfp4` after :func:`to_canonical`.

Tensor parallelism without re-tiling (:func:`tiled_slice`; ``dim`` names the axis of the logical
``W`` [N, K], as in the DeepSeek role table, not of the stored tensors):

* column-parallel (``dim=0``, split N over ``world`` ranks) iff ``N % (256 * world) == 0``:
  each rank keeps whole N3 groups, a strided gather of 128-byte runs;
* row-parallel (``dim=1``, split K) iff ``K % (64 * world) == 0``: each rank keeps whole K3
  slabs, i.e. contiguous rows of the stored ``weight`` and ``weight_scale``.

Any other degree splits a 256-column or 64-row unit; the canonical slice could not be tiled.
DeepSeek-V3 [derived]: expert gate/up (N = 2048) split N over 1, 2, 4 or 8 ranks; expert down
(K = 2048) splits K over any divisor of 32; the dense MLP (18432) over any divisor of 72 / 288.
The tile order itself (to and from the canonical layout, slicing, streaming placement) lives in
``formats/nvfp4_ascend_tiles.py``; this module holds the load-time soft-float scale fold, the
streaming chunk format and the registered format, and re-exports the tile functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import _quant_native
from ._lazy import torch
from .arrays import native
from .base import Streaming, TensorMeta, WeightFormat, register
from .nvfp4 import BLOCK, Nvfp4
from .nvfp4_ascend_tiles import (
    K_ALIGN,
    K_SPLIT,
    N_ALIGN,
    N_SPLIT,
    RUN,
    TILE,
    check_tileable,
    place_tiled,
    tiled_slice,
    to_canonical,
    to_tiled,
)

__all__ = [
    "K_ALIGN",
    "N_ALIGN",
    "TILE",
    "Nvfp4Ascend",
    "e2m1_to_bf16_soft",
    "e4m3_to_bf16_soft",
    "npu_scale_bf16",
    "tiled_slice",
    "to_canonical",
    "to_tiled",
]

# Bit tricks of fp4.md §3: place the fields in the BF16 exponent/mantissa, then one multiply.
_BF16_2POW126 = 0x7E80  # E2M1 bias 1 -> BF16 bias 127
_BF16_2POW120 = 0x7B80  # E4M3 bias 7 -> BF16 bias 127


def _as_bf16(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns 0..0xFFFF -> bfloat16 with those bits."""
    signed = bits - ((bits & 0x8000) << 1)  # two's complement for int16
    return signed.to(torch.int16).view(torch.bfloat16)


def e2m1_to_bf16_soft(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15, any integer dtype) -> BF16 by shifts and one multiply (fp4.md §3).

    ``bits = (n & 8) << 12 | (n & 7) << 6`` puts the sign in bit 15 and (e1 e0 m) in bits 8..6;
    that BF16 is value * 2^-126 (code 1/9, ±0.5, lands on a BF16 subnormal) and ``* 2^126``
    restores it. Mirrors ascend-kernel ``fp4_dequant`` (test_group_gemm_fp4.py).
    """
    n = codes.to(torch.int32) & 0xF
    return _as_bf16(((n & 0x8) << 12) | ((n & 0x7) << 6)) * _as_bf16(torch.tensor(_BF16_2POW126))


def e4m3_to_bf16_soft(scale_bits: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> BF16 by shifts and one multiply (chitu ``anti_quant_fp8``); NaN -> ±480."""
    s = scale_bits.view(torch.uint8).to(torch.int32)
    return _as_bf16(((s & 0x80) << 8) | ((s & 0x7F) << 4)) * _as_bf16(torch.tensor(_BF16_2POW120))


def npu_scale_bf16(tiled: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's BF16 [K/16, N] group scale: bf16(f32(e4m3_soft(weight_scale)) * s2)."""
    sb = e4m3_to_bf16_soft(tiled["weight_scale"]).to(torch.float32)
    return (sb * tiled["weight_scale_2"].to(torch.float32)).to(torch.bfloat16)


@dataclass(frozen=True)
class _KMajorChunks(Nvfp4):
    """Canonical codes and scales of a block of rows, stored K-major and untiled: weight
    [K, N/2] packed along N, weight_scale [K/16, N] (the streaming chunk format of the tiled
    layout; its ``place`` tiles the codes as they come)."""

    _K_MAJOR: ClassVar[bool] = True
    native_into: ClassVar[bool] = True  # quantize_array_into: straight into the tile order

    def quantize_array_into(
        self, rows: np.ndarray, row0: int, out: dict[str, np.ndarray], **options: Any
    ) -> dict[str, np.ndarray]:
        """Rows ``row0`` .. quantized by the kernel straight into the tiled ``out["weight"]``
        [K, N/2] (its 8-row words are the tile's 4-byte units) and ``out["weight_scale"]``
        [K/16, N]; returns ``weight_scale_2``."""
        s2 = self._array_scale_2(rows, options)
        target = (out["weight"], out["weight_scale"])
        got = _quant_native.nvfp4_array(rows, float(s2), "tiled", target, row0)
        native(got, f"{self.name}: rows {row0}+")
        return {"weight_scale_2": np.array(s2)}

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = shape
        out = super().stored(shape)
        out["weight"] = TensorMeta("U8", (k, n // 2))
        out["weight_scale"] = TensorMeta("F8_E4M3", (k // BLOCK, n))
        return out

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return (codes[0::2] | (codes[1::2] << 4)).T  # (K, n/2): even n low nibble

    def _quantize_torch(self, weight: torch.Tensor, given: Any) -> dict[str, torch.Tensor]:
        out = super()._quantize_torch(weight, given)
        out["weight_scale"] = out["weight_scale"].T  # (K/16, n)
        return out


@dataclass(frozen=True)
class Nvfp4Ascend(WeightFormat):
    """NVFP4 in the Ascend tiled layout (see the module docstring)."""

    name: ClassVar[str] = "nvfp4_ascend"
    keys: ClassVar[frozenset[str]] = Nvfp4.keys
    optional_keys: ClassVar[frozenset[str]] = Nvfp4.optional_keys
    with_input_scale: bool = False

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Nvfp4Ascend, tuple[int, int]]:
        k, half = metas["weight"].shape  # tiled [K, N/2]
        return dataclasses.replace(self, with_input_scale="input_scale" in metas), (2 * half, k)

    def _canonical(self) -> Nvfp4:
        return Nvfp4(with_input_scale=self.with_input_scale)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        check_tileable(*shape)
        chunk = _KMajorChunks(with_input_scale=self.with_input_scale)
        axes = dict(chunk.streaming(shape).axes, weight=1, weight_scale=1)
        return Streaming(chunk, axes, needs_amax=True, place=place_tiled)

    def shard_view(self, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """``weight`` as (K3, K1, K2, N2, N3, 128-byte run), the view of :func:`tiled_slice`.

        A slice of N3 (dim 4) is its column split, a slice of K3 (dim 0) its row split, so
        every legal shard is one slice and equals ``tiled_slice`` (tested).
        """
        n, k = shape
        view = super().shard_view(shape)
        view["weight"] = (k // K_ALIGN, K_SPLIT[1], K_SPLIT[0], N_SPLIT[0], n // N_ALIGN, RUN)
        return view

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        axes = self._canonical().shard_axes(shape)
        axes["weight"] = (4, 0)  # N3 groups of 256 outputs, K3 slabs of 64 inputs
        axes["weight_scale"] = (1, 0)  # [K/16, N]
        return axes

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = shape
        check_tileable(n, k)
        out = self._canonical().stored(shape)
        out["weight"] = TensorMeta("U8", (k, n // 2))
        out["weight_scale"] = TensorMeta("F8_E4M3", (k // BLOCK, n))
        return out

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        if weight.ndim == 2:
            check_tileable(*weight.shape)
        return to_tiled(self._canonical().quantize(weight, **options))

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        k, n = tensors["weight"].shape[0], 2 * tensors["weight"].shape[1]
        self.check_stored(tensors, (n, k))
        return self._canonical().dequantize(to_canonical(tensors))


register(Nvfp4Ascend())
