"""Inputs shared by the Ascend format tests (test_w8a8_npu*.py, test_w4a8_npu.py).

Golden values are computed by hand (see the comments), never by the code under test.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

__all__ = [
    "ACT_MAX",
    "ACT_MIN",
    "GOLDEN_Q_BYTES",
    "GOLDEN_SCALE_BYTES",
    "GOLDEN_W",
    "UNIT_ROUNDOFF",
    "as_weight",
    "bf16_weights",
    "float_weights",
]

F32_UNIT = 2.0**-24  # unit roundoff of float32
UNIT_ROUNDOFF = {torch.float32: F32_UNIT, torch.bfloat16: 2.0**-8}

# Rows chosen so that rowmax/127 is a power of two or zero (exact in F32):
#   row 0: amax 127    -> s = 1.0;    127, -63.5, 0.5, 1.5, -2.5 -> 127, -64, 0, 2, -2 (ties even)
#   row 1: amax 254    -> s = 2.0;    /2 = 127, 0.5, 1.5, -2.5, 50 -> 127, 0, 2, -2, 50
#   row 2: all zero    -> s = FLT_EPSILON = 2^-23, q = 0
#   row 3: amax 127/16 -> s = 1/16;   *16 = 127, -0.5, 1.5, -127, 0 -> 127, 0, 2, -127, 0
GOLDEN_W = torch.tensor(
    [
        [127.0, -63.5, 0.5, 1.5, -2.5],
        [254.0, 1.0, 3.0, -5.0, 100.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [7.9375, -0.03125, 0.09375, -7.9375, 0.0],
    ]
)
GOLDEN_Q_BYTES = bytes.fromhex("7fc00002fe7f0002fe3200000000007f00028100")
GOLDEN_SCALE_BYTES = bytes.fromhex("0000803f00000040000000340000803d")  # 1, 2, 2^-23, 1/16
# Activation range [-255/32, 255/16]: s_x = 1/16 + 1/32 = 0.09375, z_x = round(85) - 128 = -43.
ACT_MIN, ACT_MAX = -7.96875, 15.9375


def bf16_weights(seed: int) -> torch.Tensor:
    """BF16 rows [48, 300] whose magnitudes span eight decades."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-6, 2, 48).reshape(48, 1)  # rows over eight decades
    return (torch.randn(48, 300, generator=gen) * mags).to(torch.bfloat16)


def float_weights(shapes: st.SearchStrategy[tuple[int, int]]) -> st.SearchStrategy[np.ndarray]:
    """Float32 weights of the drawn shapes, any finite value within ±2^100."""
    elements = st.floats(-(2.0**100), 2.0**100, width=32)
    return shapes.flatmap(lambda shape: arrays(np.float32, shape, elements=elements))


def as_weight(w: np.ndarray, zero_row: bool, bf16: bool) -> torch.Tensor:
    """``w`` as a tensor, its first row zeroed and cast to BF16 when asked."""
    weight = torch.from_numpy(w.copy())
    if zero_row:
        weight[0] = 0.0
    return weight.to(torch.bfloat16) if bf16 else weight
