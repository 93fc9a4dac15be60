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
from .arrays import native
from .base import Streaming, TensorMeta, WeightFormat, register
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .errors import HetquantError
from .nvfp4 import BLOCK, Nvfp4

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

TILE = 8  # a tile is TILE k rows x TILE n columns of FP4 = 32 bytes
K_SPLIT = (4, 2, TILE)  # (K2, K1, K0) inside one K3 slab
N_SPLIT = (8, 4, TILE // 2)  # (N2, N1, N0) bytes inside one N3 group
K_ALIGN = math.prod(K_SPLIT)  # 64
N_ALIGN = 2 * math.prod(N_SPLIT)  # 256 (two n per byte)
_PERM = (0, 2, 1, 5, 4, 6, 3, 7)  # (K3, K2, K1, K0, N3, N2, N1, N0) -> K3 K1 K2 N2 N3 N1 K0 N0
_INV_PERM = tuple(sorted(range(8), key=_PERM.__getitem__))
_RUN = math.prod(N_SPLIT[1:]) * TILE  # 128 contiguous bytes per (K3, K1, K2, N2, N3)

# Bit tricks of fp4.md §3: place the fields in the BF16 exponent/mantissa, then one multiply.
_BF16_2POW126 = 0x7E80  # E2M1 bias 1 -> BF16 bias 127
_BF16_2POW120 = 0x7B80  # E4M3 bias 7 -> BF16 bias 127


def _check_tileable(n: int, k: int) -> None:
    if k % K_ALIGN or n % N_ALIGN:
        raise HetquantError(
            f"nvfp4_ascend: weight [N={n}, K={k}] cannot be tiled; the Ascend FP4 layout needs "
            f"K % {K_ALIGN} == 0 and N % {N_ALIGN} == 0 — use the canonical nvfp4 format"
        )


def _tile(kn: torch.Tensor) -> torch.Tensor:
    """Row-major packed [K, N/2] -> the same bytes in tile order, shape [K, N/2] (the C++
    kernel's 4-byte gather where it is built: ~10× torch's 8-D permute; same bytes, tested)."""
    tiled = _quant_native.nvfp4_tile(kn)
    return tiled if tiled is not None else _tile_torch(kn)


def _tile_torch(kn: torch.Tensor) -> torch.Tensor:
    """The reference of :func:`_tile`."""
    k, nb = kn.shape
    t = kn.reshape(k // K_ALIGN, *K_SPLIT, nb // (N_ALIGN // 2), *N_SPLIT)  # (K3,K2,K1,K0,N3,..)
    return t.permute(_PERM).contiguous().reshape(k, nb)


def _untile(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_tile`."""
    k, nb = tiled.shape
    dims = (k // K_ALIGN, *K_SPLIT, nb // (N_ALIGN // 2), *N_SPLIT)
    t = tiled.reshape([dims[p] for p in _PERM])  # (K3,K1,K2,N2,N3,N1,K0,N0)
    return t.permute(_INV_PERM).contiguous().reshape(k, nb)


def _transpose_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] packed along C -> uint8 [C, R/2] packed along R (even index low nibble)."""
    return pack_nibbles_u8(unpack_nibbles_u8(packed).T)


def to_tiled(canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical NVFP4 tensors (weight [N, K/2], weight_scale [N, K/16], ...) -> tiled layout."""
    weight, scale = canonical["weight"], canonical["weight_scale"]
    n, k = weight.shape[0], 2 * weight.shape[1]
    _check_tileable(n, k)
    if tuple(scale.shape) != (n, k // BLOCK):
        raise HetquantError(
            f"nvfp4_ascend.to_tiled: weight_scale {list(scale.shape)} != [{n}, {k // BLOCK}]"
        )
    out = dict(canonical)
    out["weight"] = _tile(_transpose_packed(weight))  # (K, N/2)
    out["weight_scale"] = scale.T.contiguous()  # (K/16, N)
    return out


def to_canonical(tiled: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exact inverse of :func:`to_tiled`."""
    weight, scale = tiled["weight"], tiled["weight_scale"]
    k, n = weight.shape[0], 2 * weight.shape[1]
    _check_tileable(n, k)
    if tuple(scale.shape) != (k // BLOCK, n):
        raise HetquantError(
            f"nvfp4_ascend.to_canonical: weight_scale {list(scale.shape)} != [{k // BLOCK}, {n}]"
        )
    out = dict(tiled)
    out["weight"] = _transpose_packed(_untile(weight))  # (N, K/2)
    out["weight_scale"] = scale.T.contiguous()  # (N, K/16)
    return out


def tiled_slice(
    tiled: Mapping[str, torch.Tensor], dim: int, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share of tiled tensors when ``W`` [N, K] is split along ``dim`` (0: N,
    1: K) over ``world`` ranks; equals ``to_tiled`` of the canonical slice. Scalars replicate.

    Raises HetquantError for a degree the module docstring does not allow.
    """
    weight, scale = tiled["weight"], tiled["weight_scale"]
    k, nb = weight.shape
    n = 2 * nb
    if not 0 <= rank < world:
        raise HetquantError(f"tiled_slice: rank {rank} outside world {world}")
    if dim not in (0, 1):
        raise HetquantError(f"tiled_slice: dim must be 0 (N, column) or 1 (K, row), got {dim}")
    size, align, what = (n, N_ALIGN, "N") if dim == 0 else (k, K_ALIGN, "K")
    if size % (align * world):
        raise HetquantError(
            f"tiled_slice: {what}={size} split over {world} ranks is not a multiple of {align} "
            f"per rank; allowed degrees divide {size // align}"
        )
    out = dict(tiled)
    if dim == 0:
        g = n // N_ALIGN // world  # N3 groups per rank
        w = weight.reshape(k // K_ALIGN, K_SPLIT[1], K_SPLIT[0], N_SPLIT[0], n // N_ALIGN, _RUN)
        out["weight"] = w[:, :, :, :, rank * g : (rank + 1) * g].reshape(k, nb // world)
        out["weight_scale"] = scale[:, rank * n // world : (rank + 1) * n // world]
    else:
        rows = k // world
        out["weight"] = weight[rank * rows : (rank + 1) * rows]
        out["weight_scale"] = scale[rank * rows // BLOCK : (rank + 1) * rows // BLOCK]
    return {key: t.contiguous() for key, t in out.items()}


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


def _tiled_index(k: int, nb: int, col0: int, cb: int) -> torch.Tensor:
    """Flat tile-order positions in a [k, nb] tensor of byte columns col0 .. col0+cb of the
    K-major codes, [k, cb] (the order of :func:`_tile`, as arithmetic)."""
    kk = torch.arange(k)[:, None]
    c = torch.arange(col0, col0 + cb)[None, :]
    k3, k2, k1, k0 = kk // 64, (kk // 16) % 4, (kk // 8) % 2, kk % 8
    n3, n2, n1, n0 = c // 128, (c // 16) % 8, (c // 4) % 4, c % 4
    slab = ((k3 * 2 + k1) * 4 + k2) * 8 + n2
    return (slab * (nb // 128) + n3) * 128 + (n1 * 8 + k0) * 4 + n0


def _place_tiled(key: str, assembled: torch.Tensor, part: torch.Tensor, start: int) -> bool:
    """``Streaming.place`` of the tiled layout: a row block's K-major codes [K, rows/2] go
    straight to their tile-order places (the C++ gather for blocks of whole 32-row runs,
    indexing otherwise); the scales are a plain copy."""
    if key != "weight":
        return False
    if not _quant_native.nvfp4_tile_into(part.contiguous(), start, assembled):
        k, nb = assembled.shape
        index = _tiled_index(k, nb, start, part.shape[1])
        assembled.view(-1)[index.reshape(-1)] = part.reshape(-1)
    return True


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
        _check_tileable(*shape)
        chunk = _KMajorChunks(with_input_scale=self.with_input_scale)
        axes = dict(chunk.streaming(shape).axes, weight=1, weight_scale=1)
        return Streaming(chunk, axes, needs_amax=True, place=_place_tiled)

    def shard_view(self, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """``weight`` as (K3, K1, K2, N2, N3, 128-byte run), the view of :func:`tiled_slice`.

        A slice of N3 (dim 4) is its column split, a slice of K3 (dim 0) its row split, so
        every legal shard is one slice and equals ``tiled_slice`` (tested).
        """
        n, k = shape
        view = super().shard_view(shape)
        view["weight"] = (k // K_ALIGN, K_SPLIT[1], K_SPLIT[0], N_SPLIT[0], n // N_ALIGN, _RUN)
        return view

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        axes = self._canonical().shard_axes(shape)
        axes["weight"] = (4, 0)  # N3 groups of 256 outputs, K3 slabs of 64 inputs
        axes["weight_scale"] = (1, 0)  # [K/16, N]
        return axes

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = shape
        _check_tileable(n, k)
        out = self._canonical().stored(shape)
        out["weight"] = TensorMeta("U8", (k, n // 2))
        out["weight_scale"] = TensorMeta("F8_E4M3", (k // BLOCK, n))
        return out

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        if weight.ndim == 2:
            _check_tileable(*weight.shape)
        return to_tiled(self._canonical().quantize(weight, **options))

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        k, n = tensors["weight"].shape[0], 2 * tensors["weight"].shape[1]
        self.check_stored(tensors, (n, k))
        return self._canonical().dequantize(to_canonical(tensors))


register(Nvfp4Ascend())
