"""Tests of formats/w8a8_npu_rows.py: the per-row int8 codec's error bound, scales held exactly in
BF16 (issue #14 item 5), codes that are the exact quotients, and the static activation
parameters.

Golden values below are computed by hand (see the comments), never by the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ascend_cases import ACT_MAX, ACT_MIN, as_weight, bf16_weights, float_weights
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import get_format
from hetquant.formats.w8a8_npu_rows import (
    SCALE_FLOOR,
    activation_qparams,
    dequantize_int8,
    weight_tensors,
)

DYN = get_format("w8a8_dynamic")


@settings(max_examples=60, deadline=None)
@given(
    w=float_weights(st.tuples(st.integers(1, 17), st.integers(1, 67))),
    zero_row=st.booleans(),
    bf16=st.booleans(),
)
def test_error_bound(w: np.ndarray, zero_row: bool, bf16: bool) -> None:
    """|W - dequantize(quantize(W))| <= s/2 per row, up to F32 rounding of W/s and q*s."""
    weight = as_weight(w, zero_row, bf16)
    t = weight_tensors(weight, "w")
    s = t["weight_scale"].double()  # (n, 1)
    err = (weight.double() - dequantize_int8(DYN, t).double()).abs()
    assert (s >= SCALE_FLOOR).all()
    assert (err <= s * (0.5 + 2.0**-16)).all()
    if zero_row:
        assert not t["weight"][0].any()


def test_activation_qparams_golden() -> None:
    # s_x = (15.9375 + 7.96875) / 255 = 0.09375 (exact in BF16); z_x = round(85) - 128 = -43
    scale, offset = activation_qparams(torch.tensor([ACT_MIN]), torch.tensor([ACT_MAX]))
    assert scale.numpy().tobytes() == bytes.fromhex("0000c03d")  # 0.09375
    assert offset.numpy().tobytes() == bytes.fromhex("00002cc2")  # -43.0
    # a range that excludes 0 is widened to contain it: [0, 25.5] / 255 = 0.1, not a BF16 value,
    # rounded UP to BF16 0x3dcd = 0.10009765625; z_x = round(-0 / s_x) - 128 = -128
    scale, offset = activation_qparams(torch.tensor([1.0]), torch.tensor([25.5]))
    assert scale.numpy().tobytes() == bytes.fromhex("0000cd3d")
    assert offset.tolist() == [-128.0]


# -- scales the consumer holds exactly (issue #14 item 5) ------------------------------------------
# Row [1, -0.5, 0.25, 0]: amax / 127 = 2^-7 · 1.00787…; BF16 keeps 7 fraction bits, so the value
# between 2^-7 · (1 + 1/128) and 2^-7 · (1 + 2/128) is rounded UP to 2^-7 · 1.015625 =
# 0.0079345703125 (bytes 00 00 02 3c as F32). Codes: 1 / s = 126.03 -> 126 (the row's extreme no
# longer reaches 127), -0.5 / s = -63.02 -> -63, 0.25 / s = 31.51 -> 32, 0 -> 0.
HELD_ROW = torch.tensor([[1.0, -0.5, 0.25, 0.0]], dtype=torch.bfloat16)


def test_held_scale_golden() -> None:
    t = weight_tensors(HELD_ROW, "w")
    assert t["weight_scale"].numpy().tobytes() == bytes.fromhex("0000023c")
    assert t["weight"].tolist() == [[126, -63, 32, 0]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_is_the_smallest_bf16_that_clips_nothing(seed: int) -> None:
    w = bf16_weights(seed)
    t = weight_tensors(w, "w")
    s = t["weight_scale"]  # (n, 1) F32
    assert torch.equal(s.to(torch.bfloat16).float(), s)  # held exactly by a BF16 parameter
    need = w.double().abs().amax(1, keepdim=True) / 127  # exact enough in F64
    need = need.clamp(min=SCALE_FLOOR)  # the smallest rows are floored at FLT_EPSILON
    assert bool((s.double() >= need).all())
    below = torch.nextafter(s.to(torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    assert bool((below.double() < need).all())  # one BF16 step down would clip
    exact = w.double() / s.double()  # the codes are the exact quotients, rounded half to even
    assert bool((exact.abs() <= 127).all())
    assert torch.equal(t["weight"], torch.round(exact).to(torch.int8))


def test_f32_weights_round_the_exact_quotient() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 257, generator=gen) * 3
    t = weight_tensors(w, "w")
    want = torch.round(w.double() / t["weight_scale"].double()).to(torch.int8)
    assert torch.equal(t["weight"], want)
