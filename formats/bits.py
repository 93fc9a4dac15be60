"""Shared nibble packing: 4-bit codes in 0..15 ↔ bytes / int32 words.

Every 4-bit format says which element goes to which nibble; these helpers take that order as an
argument so the bit twiddling exists once.
"""

from __future__ import annotations

import sys

from ._lazy import torch
from .errors import HetquantError

if (
    sys.byteorder != "little"
):  # int32 words are built by viewing bytes; safetensors is little-endian
    raise ImportError("hetquant's nibble packing assumes a little-endian machine")

__all__ = ["pack_nibbles_i32", "pack_nibbles_u8", "unpack_nibbles_i32", "unpack_nibbles_u8"]


def _check_codes(codes: torch.Tensor, per: int, what: str) -> None:
    if codes.shape[-1] % per:
        raise HetquantError(
            f"{what}: last dim {codes.shape[-1]} is not a multiple of {per}; "
            "4-bit packing never pads silently — choose a shape divisible by it"
        )


def pack_nibbles_u8(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (values 0..15) into uint8 [..., K/2]; element 2j → low nibble."""
    _check_codes(codes, 2, "pack_nibbles_u8")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)  # (..., K/2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles_u8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles_u8`: uint8 [..., K/2] → uint8 codes [..., K]."""
    p = packed.to(torch.uint8)
    out = torch.stack([p & 0xF, p >> 4], dim=-1)  # (..., K/2, 2)
    return out.reshape(*p.shape[:-1], -1)


def pack_nibbles_i32(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack codes [..., K] (values 0..15) into int32 [..., K/8].

    ``order[i]`` is the index (within each group of 8 consecutive elements) of the element
    stored at bits ``4i..4i+3``. ``order=(0,1,…,7)`` is the plain order (compressed-tensors);
    AutoAWQ's GEMM order is ``(0, 2, 4, 6, 1, 3, 5, 7)``.
    """
    _check_codes(codes, 8, "pack_nibbles_i32")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 8)[..., list(order)]  # (..., K/8, 8)
    # Nibble i of a word is bits 4i..4i+3: byte i//2 of the little-endian word, low half if i even.
    return pack_nibbles_u8(c).contiguous().view(torch.int32).squeeze(-1)  # (..., K/8)


def unpack_nibbles_i32(
    words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))
) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles_i32`: int32 [..., K/8] → uint8 codes [..., K]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)  # (8,)
    nib = (words.to(torch.int64)[..., None] >> shifts) & 0xF  # (..., K/8, 8) in nibble order
    inverse = [order.index(k) for k in range(8)]
    return nib[..., inverse].to(torch.uint8).reshape(*words.shape[:-1], -1)
