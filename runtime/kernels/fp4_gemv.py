"""FP4 GEMV for the CPU expert pool: DeepSeek-V4's experts as the hybrid keeps them
(``formats/fp4_cpu.py``: E2M1 codes, UE8M0 scale per 32 inputs).

``fp4_gemv(packed, scale, x)`` is :func:`hetquant.formats.fp4_cpu.fp4_gemv_int8`: activations
quantized to int8 per token, per 32-group an exact integer sum of ``2·E2M1[c] · q`` through the
16-entry table ``E2M1_X2``, scaled by the group's power of two and summed in float64 — in torch.
No native kernel yet: the int8 dot-product paths of ``int4_gemv`` (AVX-512 VNNI, AVX2, NEON
sdot) can run the same integer sums (a table lookup from nibble to int8 in place of ``c − 8``),
which is future work; until then this is the pool's only path for the format, so every subpool
and every ISA gives the same bits (one torch computation, no ISA-specific code).
"""

from __future__ import annotations

from typing import Any

import torch

from hetquant.formats.fp4_cpu import fp4_gemv_int8

__all__ = ["fp4_gemv"]


def fp4_gemv(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, **_: Any) -> torch.Tensor:
    """``x · Wᵀ`` [T, N] (float32) for codes U8 [N, K/2] and UE8M0 scales [N, K/32]; the int4
    kernel's options (backend, threads, precision) do not apply and are ignored."""
    return fp4_gemv_int8(packed, scale, x)
