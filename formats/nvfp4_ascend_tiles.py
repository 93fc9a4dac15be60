"""The tile order of ``nvfp4_ascend`` (``formats/nvfp4_ascend.py`` documents the layout and its
tensor-parallel rules): canonical NVFP4 tensors to and from the tiled layout, a rank's share of
tiled tensors without re-tiling, and a row block's codes put straight into their tile-order places
while a weight streams in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from . import _quant_native
from ._lazy import torch
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .errors import HetquantError
from .nvfp4 import BLOCK

__all__ = [
    "K_ALIGN",
    "K_SPLIT",
    "N_ALIGN",
    "N_SPLIT",
    "RUN",
    "TILE",
    "check_tileable",
    "place_tiled",
    "tile",
    "tile_torch",
    "tiled_index",
    "tiled_slice",
    "to_canonical",
    "to_tiled",
    "transpose_packed",
    "untile",
]

TILE = 8  # a tile is TILE k rows x TILE n columns of FP4 = 32 bytes
K_SPLIT = (4, 2, TILE)  # (K2, K1, K0) inside one K3 slab
N_SPLIT = (8, 4, TILE // 2)  # (N2, N1, N0) bytes inside one N3 group
K_ALIGN = math.prod(K_SPLIT)  # 64
N_ALIGN = 2 * math.prod(N_SPLIT)  # 256 (two n per byte)
_PERM = (0, 2, 1, 5, 4, 6, 3, 7)  # (K3, K2, K1, K0, N3, N2, N1, N0) -> K3 K1 K2 N2 N3 N1 K0 N0
_INV_PERM = tuple(sorted(range(8), key=_PERM.__getitem__))
RUN = math.prod(N_SPLIT[1:]) * TILE  # 128 contiguous bytes per (K3, K1, K2, N2, N3)


def check_tileable(n: int, k: int) -> None:
    """Raise unless a weight [N, K] tiles: ``K % K_ALIGN == 0`` and ``N % N_ALIGN == 0``."""
    if k % K_ALIGN or n % N_ALIGN:
        raise HetquantError(
            f"nvfp4_ascend: weight [N={n}, K={k}] cannot be tiled; the Ascend FP4 layout needs "
            f"K % {K_ALIGN} == 0 and N % {N_ALIGN} == 0 — use the canonical nvfp4 format"
        )


def tile(kn: torch.Tensor) -> torch.Tensor:
    """Row-major packed [K, N/2] -> the same bytes in tile order, shape [K, N/2] (the C++
    kernel's 4-byte gather where it is built: ~10× torch's 8-D permute; same bytes, tested)."""
    tiled = _quant_native.nvfp4_tile(kn)
    return tiled if tiled is not None else tile_torch(kn)


def tile_torch(kn: torch.Tensor) -> torch.Tensor:
    """The reference of :func:`tile`."""
    k, nb = kn.shape
    t = kn.reshape(k // K_ALIGN, *K_SPLIT, nb // (N_ALIGN // 2), *N_SPLIT)  # (K3,K2,K1,K0,N3,..)
    return t.permute(_PERM).contiguous().reshape(k, nb)


def untile(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tile`."""
    k, nb = tiled.shape
    dims = (k // K_ALIGN, *K_SPLIT, nb // (N_ALIGN // 2), *N_SPLIT)
    t = tiled.reshape([dims[p] for p in _PERM])  # (K3,K1,K2,N2,N3,N1,K0,N0)
    return t.permute(_INV_PERM).contiguous().reshape(k, nb)


def transpose_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] packed along C -> uint8 [C, R/2] packed along R (even index low nibble)."""
    return pack_nibbles_u8(unpack_nibbles_u8(packed).T)


def to_tiled(canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical NVFP4 tensors (weight [N, K/2], weight_scale [N, K/16], ...) -> tiled layout."""
    weight, scale = canonical["weight"], canonical["weight_scale"]
    n, k = weight.shape[0], 2 * weight.shape[1]
    check_tileable(n, k)
    if tuple(scale.shape) != (n, k // BLOCK):
        raise HetquantError(
            f"nvfp4_ascend.to_tiled: weight_scale {list(scale.shape)} != [{n}, {k // BLOCK}]"
        )
    out = dict(canonical)
    out["weight"] = tile(transpose_packed(weight))  # (K, N/2)
    out["weight_scale"] = scale.T.contiguous()  # (K/16, N)
    return out


def to_canonical(tiled: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exact inverse of :func:`to_tiled`."""
    weight, scale = tiled["weight"], tiled["weight_scale"]
    k, n = weight.shape[0], 2 * weight.shape[1]
    check_tileable(n, k)
    if tuple(scale.shape) != (k // BLOCK, n):
        raise HetquantError(
            f"nvfp4_ascend.to_canonical: weight_scale {list(scale.shape)} != [{k // BLOCK}, {n}]"
        )
    out = dict(tiled)
    out["weight"] = transpose_packed(untile(weight))  # (N, K/2)
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
        w = weight.reshape(k // K_ALIGN, K_SPLIT[1], K_SPLIT[0], N_SPLIT[0], n // N_ALIGN, RUN)
        out["weight"] = w[:, :, :, :, rank * g : (rank + 1) * g].reshape(k, nb // world)
        out["weight_scale"] = scale[:, rank * n // world : (rank + 1) * n // world]
    else:
        rows = k // world
        out["weight"] = weight[rank * rows : (rank + 1) * rows]
        out["weight_scale"] = scale[rank * rows // BLOCK : (rank + 1) * rows // BLOCK]
    return {key: t.contiguous() for key, t in out.items()}


def tiled_index(k: int, nb: int, col0: int, cb: int) -> torch.Tensor:
    """Flat tile-order positions in a [k, nb] tensor of byte columns col0 .. col0+cb of the
    K-major codes, [k, cb] (the order of :func:`tile`, as arithmetic)."""
    kk = torch.arange(k)[:, None]
    c = torch.arange(col0, col0 + cb)[None, :]
    k3, k2, k1, k0 = kk // 64, (kk // 16) % 4, (kk // 8) % 2, kk % 8
    n3, n2, n1, n0 = c // 128, (c // 16) % 8, (c // 4) % 4, c % 4
    slab = ((k3 * 2 + k1) * 4 + k2) * 8 + n2
    return (slab * (nb // 128) + n3) * 128 + (n1 * 8 + k0) * 4 + n0


def place_tiled(key: str, assembled: torch.Tensor, part: torch.Tensor, start: int) -> bool:
    """``Streaming.place`` of the tiled layout: a row block's K-major codes [K, rows/2] go
    straight to their tile-order places (the C++ gather for blocks of whole 32-row runs,
    indexing otherwise); the scales are a plain copy."""
    if key != "weight":
        return False
    if not _quant_native.nvfp4_tile_into(part.contiguous(), start, assembled):
        k, nb = assembled.shape
        index = tiled_index(k, nb, start, part.shape[1])
        assembled.view(-1)[index.reshape(-1)] = part.reshape(-1)
    return True
