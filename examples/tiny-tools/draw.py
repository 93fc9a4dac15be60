"""Seeded draws that give the same floats on every CPU, for every tiny model's generator.

``torch.randn`` is not one: its float32 kernel computes Box-Muller's log / cos with ATen's
vectorised (Sleef) functions under AVX2 / AVX-512 and with libm under ATen's ``default``
capability, so some draws differ by an ulp, and BF16 rounding does not hide every one (five of
the generated sources' golden files did not match under ``ATEN_CPU_CAPABILITY=default``).

Here every value is a sum of four uniform integers in [0, 2**24) (Irwin-Hall, zero mean, unit
variance, range ±2·sqrt(3)): ``torch.randint`` draws them one at a time from the generator, and
the rest is exact integer and correctly rounded float64 arithmetic, which no instruction set
changes.
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["normal", "seeded"]

_BITS = 24


def normal(seed: int, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Float32 ``shape`` of zero-mean, unit-variance draws from ``torch.Generator`` seed ``seed``
    (a drop-in for ``torch.randn(shape, generator=torch.Generator().manual_seed(seed))``)."""
    return _irwin_hall(seed, tuple(shape)).to(torch.float32)


def seeded(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Float64 draws as ``normal``, its generator seeded from ``seed`` and the tensor's name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return _irwin_hall(int.from_bytes(digest[:8], "little") >> 1, shape)


def _irwin_hall(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, 1 << _BITS, (4, *shape), generator=gen, dtype=torch.int64)
    # [4, *shape] int64 → [*shape] float64: the sum is exact, /2**24 and -2 are exact
    return (draws.sum(0).to(torch.float64) / (1 << _BITS) - 2.0) * math.sqrt(3.0)
