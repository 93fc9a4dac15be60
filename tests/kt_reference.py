"""kt-kernel AMXINT4 byte positions written out from reference/cpu_experts.md §7.1, element by
element (independent of ``formats/kt_amxint4.py``), for golden-byte and round-trip tests."""

from __future__ import annotations

from functools import cache

import torch

__all__ = ["decode_quant", "element_offsets", "offset"]


def offset(n: int, k: int, row: int, col: int) -> tuple[int, int]:
    """(byte, 0 low / 1 high nibble) of element (row, col) of an [n, k] matrix, per §7.1."""
    n0, k0 = row // 128 * 128, col // 3584 * 3584  # its 128-row block, its 3584-k block
    nb, kb = min(128, n - n0), min(3584, k - k0)
    group, i = divmod(row - n0, 32)  # 32-row group, row in the group
    chunk, e = divmod(col - k0, 128)  # 128-k chunk, element in the chunk
    j, high = e % 64, e // 64  # byte j of the row's 64 bytes: elements j (low), j + 64 (high)
    tile = (n0 * k + k0 * nb + 32 * group * kb + 128 * chunk * 32) // 2
    half, r = divmod(i, 16)
    w, b = divmod(j, 4)
    return tile + half * 1024 + w * 64 + r * 4 + b, high


@cache
def element_offsets(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``offset`` of every element: byte index [n, k] (int64) and nibble [n, k] (0 / 1)."""
    pos = [offset(n, k, r, c) for r in range(n) for c in range(k)]
    byte = torch.tensor([p[0] for p in pos], dtype=torch.int64).view(n, k)
    high = torch.tensor([p[1] for p in pos], dtype=torch.int64).view(n, k)
    return byte, high


def decode_quant(buf: bytes, n: int, k: int) -> torch.Tensor:
    """A quant file's bytes → offset-binary codes ``q + 8`` [n, k] (uint8)."""
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(torch.int64)
    byte, high = element_offsets(n, k)
    nib = (raw[byte] >> (4 * high)) & 0xF  # two's-complement q
    return (nib ^ 8).to(torch.uint8)
