"""Tests for the Ascend W8A8 formats (formats/w8a8_npu.py).

Golden values below are computed by hand (see the comments), never by the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hetquant.formats import FORMATS, HetquantError, get_format
from hetquant.formats import w8a8_npu as w8

DYN = get_format("w8a8_dynamic")
STATIC = get_format("w8a8")
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


def test_registered() -> None:
    assert isinstance(FORMATS["w8a8_dynamic"], w8.W8A8Dynamic)
    assert isinstance(FORMATS["w8a8"], w8.W8A8Static)


def test_dynamic_golden_bytes() -> None:
    w_before = GOLDEN_W.clone()
    t = DYN.quantize(GOLDEN_W)
    assert torch.equal(GOLDEN_W, w_before)  # pure
    assert t["weight"].dtype == torch.int8
    assert t["weight"].numpy().tobytes() == GOLDEN_Q_BYTES
    assert t["weight_scale"].numpy().tobytes() == GOLDEN_SCALE_BYTES
    assert t["weight_offset"].numpy().tobytes() == bytes(16)
    # q * s: row 3 is 127/16, 0, 2/16, -127/16, 0
    expected = torch.tensor(
        [
            [127.0, -64.0, 0.0, 2.0, -2.0],
            [254.0, 0.0, 4.0, -4.0, 100.0],
            [0.0] * 5,
            [7.9375, 0.0, 0.125, -7.9375, 0.0],
        ]
    )
    assert torch.equal(DYN.dequantize(t), expected)


def test_static_golden() -> None:
    t = STATIC.quantize(GOLDEN_W, act_min=ACT_MIN, act_max=ACT_MAX)
    assert t["weight"].numpy().tobytes() == GOLDEN_Q_BYTES
    assert t["weight_scale"].numpy().tobytes() == GOLDEN_SCALE_BYTES
    assert t["input_scale"].numpy().tobytes() == bytes.fromhex("0000c03d")  # 0.09375
    assert t["input_offset"].numpy().tobytes() == bytes.fromhex("00002cc2")  # -43.0
    # deq_scale = 0.09375 * s; quant_bias = 43 * row sums of q (63, 177, 0, 2)
    deq = torch.tensor([0.09375, 0.1875, 0.09375 * 2**-23, 0.005859375])
    assert torch.equal(t["deq_scale"], deq)
    assert t["quant_bias"].tolist() == [2709, 7611, 0, 86]
    assert t["quant_bias"].dtype == torch.int32


def test_static_golden_matmul() -> None:
    # x / 0.09375 = 16, -8, 0, 32, 1 -> x_q = those - 43; (x_q + 43) . q[n] * deq_scale[n]:
    # row 0: 2032 + 512 + 64 - 2 = 2606 * 0.09375;  row 1: 2032 - 64 + 50 = 2018 * 0.1875
    # row 3: 2032 - 4064 = -2032 * 0.005859375
    t = STATIC.quantize(GOLDEN_W, act_min=ACT_MIN, act_max=ACT_MAX)
    x = torch.tensor([[1.5, -0.75, 0.0, 3.0, 0.09375]])
    y = w8.static_quant_matmul(x, t)
    assert torch.equal(y, torch.tensor([[244.3125, 378.375, 0.0, -11.90625]]))


def test_dynamic_quant_golden() -> None:
    # row 0: 127 / 1 = 127 -> 127, -63.5 -> -64 (tie to even), 31.75 -> 32; row 1 is all zero
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    x_q, x_scale = w8.dynamic_quant(x)
    assert x_q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0]]
    assert x_scale.dtype == torch.float32
    assert x_scale.tolist() == [float(np.float32(1 / 127)), 0.0]  # 1 / (127 / 1) in F32


@settings(max_examples=60, deadline=None)
@given(
    w=st.tuples(st.integers(1, 17), st.integers(1, 67)).flatmap(
        lambda shape: arrays(np.float32, shape, elements=st.floats(-(2.0**100), 2.0**100, width=32))
    ),
    zero_row=st.booleans(),
    bf16=st.booleans(),
)
def test_error_bound(w: np.ndarray, zero_row: bool, bf16: bool) -> None:
    """|W - dequantize(quantize(W))| <= s/2 per row, up to F32 rounding of W/s and q*s."""
    weight = torch.from_numpy(w.copy())
    if zero_row:
        weight[0] = 0.0
    if bf16:
        weight = weight.to(torch.bfloat16)
    t = DYN.quantize(weight)
    s = t["weight_scale"].double()  # (n, 1)
    err = (weight.double() - DYN.dequantize(t).double()).abs()
    assert (s >= w8.SCALE_FLOOR).all()
    assert (err <= s * (0.5 + 2.0**-16)).all()
    if zero_row:
        assert not t["weight"][0].any()


@pytest.mark.parametrize("fmt", [DYN, STATIC], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 130), (576, 9)])
def test_stored_matches_quantize(fmt, shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t = fmt.quantize(weight, act_min=-2.0, act_max=3.0) if fmt is STATIC else fmt.quantize(weight)
    fmt.check_stored(t, shape)
    assert fmt.nbytes(shape) == sum(v.numel() * v.element_size() for v in t.values())


def _dequant_bound(x_hat, w_hat, step, unit) -> torch.Tensor:
    """Bound on |x @ w_hat.T - y| for y = the int8 op, x_hat its dequantized activations.

    |x - x_hat| <= step/2 per element (step = activation scale; (1 + 2^-20) covers F32 rounding
    of x * (1/step)), so the activation-quantization error is <= step/2 * sum_k |w_hat[n, k]|.
    The op computes x_hat @ w_hat.T exactly in integers and then rounds: int32 -> F32, two F32
    multiplies and the cast to the output dtype, <= (unit + 2^-21) * sum_k |x_hat| |w_hat|.
    """
    act = 0.5 * step * (1 + 2.0**-20) * w_hat.abs().sum(1)  # (m, 1) * (n,) -> (m, n)
    return act + (unit + 2.0**-21) * (x_hat.abs() @ w_hat.abs().T)  # (m, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_dynamic_matmul_vs_dequantize(dtype: torch.dtype, param_dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(33, 70, generator=gen) * torch.logspace(-3, 1, 70)  # uneven columns
    t = DYN.quantize(weight)
    x = (torch.randn(2, 9, 70, generator=gen) * 5).to(dtype)
    x[0, 3] = 0.0  # an all-zero token
    y = w8.dynamic_quant_matmul(x, t, param_dtype=param_dtype)
    assert y.dtype == dtype and y.shape == (2, 9, 33)
    w_hat = DYN.dequantize(t).double()  # (n, k)
    x2 = x.reshape(-1, 70).double()  # (m, k)
    x_q, x_scale = w8.dynamic_quant(x.reshape(-1, 70))
    x_hat = x_q.double() * x_scale.double()[:, None]  # (m, k)
    unit = UNIT_ROUNDOFF[dtype] + (2.0**-8 if param_dtype is not None else 0.0)
    bound = _dequant_bound(x_hat, w_hat, x_scale.double()[:, None], unit)
    err = (x2 @ w_hat.T - y.reshape(-1, 33).double()).abs()
    assert (err <= bound).all()
    assert not y[0, 3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_matmul_vs_dequantize(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(21, 48, generator=gen)
    x = (torch.rand(12, 48, generator=gen) * 6 - 1.5).to(dtype)  # inside the calibrated range
    t = STATIC.quantize(weight, act_min=x.min(), act_max=x.max())
    y = w8.static_quant_matmul(x, t)
    s_x, z_x = t["input_scale"].double(), t["input_offset"].double()
    x_q = torch.round(x.double() / s_x + z_x).clamp(-128, 127)  # (m, k)
    x_hat = (x_q - z_x) * s_x  # (m, k)
    w_hat = STATIC.dequantize(t).double()
    bound = _dequant_bound(x_hat, w_hat, s_x, UNIT_ROUNDOFF[dtype])
    assert ((x.double() @ w_hat.T - y.double()).abs() <= bound).all()


def test_description_entries_golden() -> None:
    p = "model.layers.3.mlp.experts.7.down_proj"
    assert w8.description_entries(p, "w8a8_dynamic") == {
        f"{p}.weight": "W8A8_DYNAMIC",
        f"{p}.weight_scale": "W8A8_DYNAMIC",
        f"{p}.weight_offset": "W8A8_DYNAMIC",
    }
    q = "model.layers.0.self_attn.q_a_proj"
    assert w8.description_entries(q, "w8a8") == {
        f"{q}.{name}": "W8A8"
        for name in (
            "weight",
            "weight_scale",
            "weight_offset",
            "input_scale",
            "input_offset",
            "deq_scale",
            "quant_bias",
        )
    }
    r = "model.layers.0.self_attn.kv_b_proj"
    assert w8.description_entries(r, "bf16") == {f"{r}.weight": "FLOAT"}
    header = w8.description_header()  # msModelSlim's ascendv1.py:209-227, in its order
    assert list(header.items()) == [
        ("version", "1.0.0"),
        ("model_quant_type", "W8A8_DYNAMIC"),
        ("metadata", {}),
        ("group_size", 0),
        ("optional", {}),
    ]
    assert w8.description_header("W8A8")["model_quant_type"] == "W8A8"


@pytest.mark.parametrize(
    ("weight", "needle"),
    [
        (torch.ones(8), "2-D"),
        (torch.ones(2, 3, 4), "2-D"),
        (torch.ones(0, 4), "non-empty"),
        (torch.ones(3, 4, dtype=torch.int8), "must be float"),
        (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), "NaN/Inf"),
        (torch.tensor([[1.0, 2.0], [float("inf"), 1.0]]), "first at [1, 0]"),
    ],
)
@pytest.mark.parametrize("fmt", [DYN, STATIC], ids=lambda f: f.name)
def test_bad_weight_refused(fmt, weight: torch.Tensor, needle: str) -> None:
    kwargs = {"act_min": -1.0, "act_max": 1.0} if fmt is STATIC else {}
    with pytest.raises(HetquantError, match=r"layers\.0\.q_a_proj") as info:
        fmt.quantize(weight, name="layers.0.q_a_proj", **kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "act_min is missing"),
        ({"act_min": -1.0}, "act_max is missing"),
        ({"act_max": 1.0}, "act_min is missing"),
        ({"act_min": 2.0, "act_max": 1.0}, "act_min 2.0 > act_max 1.0"),
        ({"act_min": float("nan"), "act_max": 1.0}, "finite"),
        ({"act_min": torch.zeros(2), "act_max": 1.0}, "one finite number"),
    ],
)
def test_static_needs_stats(kwargs: dict, needle: str) -> None:
    with pytest.raises(HetquantError, match="o_proj") as info:
        STATIC.quantize(torch.ones(2, 2), name="o_proj", **kwargs)
    assert needle in str(info.value)


def test_other_bad_inputs_refused() -> None:
    for bad_shape in [(3,), (0, 4), (4, 5, 6)]:
        with pytest.raises(HetquantError, match="2-D"):
            DYN.stored(bad_shape)
    t = DYN.quantize(torch.ones(3, 4))
    with pytest.raises(HetquantError, match="weight_offset"):
        DYN.dequantize({k: v for k, v in t.items() if k != "weight_offset"})
    with pytest.raises(HetquantError, match=r"x \[\.\.\., 5\] does not match weight \[3, 4\]"):
        w8.dynamic_quant_matmul(torch.ones(2, 5), t)
    with pytest.raises(HetquantError, match="NaN/Inf"):
        w8.dynamic_quant_matmul(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), t)
    wide = DYN.quantize(torch.ones(1, 65536))
    with pytest.raises(HetquantError, match="65535"):
        w8.dynamic_quant_matmul(torch.ones(1, 65536), wide)
    with pytest.raises(HetquantError, match="fp8_block"):
        w8.description_entries("model.layers.0.mlp.up_proj", "fp8_block")
    with pytest.raises(HetquantError, match="W4A8"):
        w8.description_header("W4A8")


# -- scales the consumer holds exactly (issue #14 item 5) ------------------------------------------
# Row [1, -0.5, 0.25, 0]: amax / 127 = 2^-7 · 1.00787…; BF16 keeps 7 fraction bits, so the value
# between 2^-7 · (1 + 1/128) and 2^-7 · (1 + 2/128) is rounded UP to 2^-7 · 1.015625 =
# 0.0079345703125 (bytes 00 00 02 3c as F32). Codes: 1 / s = 126.03 -> 126 (the row's extreme no
# longer reaches 127), -0.5 / s = -63.02 -> -63, 0.25 / s = 31.51 -> 32, 0 -> 0.
HELD_ROW = torch.tensor([[1.0, -0.5, 0.25, 0.0]], dtype=torch.bfloat16)


def test_held_scale_golden() -> None:
    t = DYN.quantize(HELD_ROW)
    assert t["weight_scale"].numpy().tobytes() == bytes.fromhex("0000023c")
    assert t["weight"].tolist() == [[126, -63, 32, 0]]


def _bf16_weights(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-6, 2, 48).reshape(48, 1)  # rows over eight decades
    return (torch.randn(48, 300, generator=gen) * mags).to(torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_is_the_smallest_bf16_that_clips_nothing(seed: int) -> None:
    w = _bf16_weights(seed)
    t = DYN.quantize(w)
    s = t["weight_scale"]  # (n, 1) F32
    assert torch.equal(s.to(torch.bfloat16).float(), s)  # held exactly by a BF16 parameter
    need = w.double().abs().amax(1, keepdim=True) / 127  # exact enough in F64
    need = need.clamp(min=w8.SCALE_FLOOR)  # the smallest rows are floored at FLT_EPSILON
    assert bool((s.double() >= need).all())
    below = torch.nextafter(s.to(torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
    assert bool((below.double() < need).all())  # one BF16 step down would clip
    exact = w.double() / s.double()  # the codes are the exact quotients, rounded half to even
    assert bool((exact.abs() <= 127).all())
    assert torch.equal(t["weight"], torch.round(exact).to(torch.int8))


def test_f32_weights_round_the_exact_quotient() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 257, generator=gen) * 3
    t = DYN.quantize(w)
    want = torch.round(w.double() / t["weight_scale"].double()).to(torch.int8)
    assert torch.equal(t["weight"], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm_ascend_bf16_scale_load_changes_nothing(dtype: torch.dtype) -> None:
    """vllm-ascend copies weight_scale into a BF16 parameter: bit-identical output to F32."""
    t = DYN.quantize(_bf16_weights(4).float())
    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    held = w8.dynamic_quant_matmul(x, t, param_dtype=torch.bfloat16)
    assert torch.equal(held, w8.dynamic_quant_matmul(x, t))


def test_static_scales_held_and_deq_scale_exact() -> None:
    t = STATIC.quantize(_bf16_weights(6), act_min=-3.3, act_max=7.1)
    s_x, s_w = t["input_scale"], t["weight_scale"]
    for s in (s_x, s_w):
        assert torch.equal(s.to(torch.bfloat16).float(), s)
    assert float(s_x) >= (7.1 + 3.3) / 255  # rounded up: the range fits in 255 steps
    assert torch.equal(t["deq_scale"].double(), s_x.double() * s_w.double().squeeze(1))
    assert torch.equal(t["input_offset"], torch.round(3.3 / s_x.double()).float() - 128)
