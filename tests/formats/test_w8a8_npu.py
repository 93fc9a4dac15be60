"""Tests for the Ascend W8A8 formats (formats/w8a8_npu.py): registration, golden bytes, stored
shapes and refused inputs. The codec, the reference ops and the description file have their own
test files (test_w8a8_npu_rows.py, test_w8a8_npu_ops.py, test_ascend_description.py).

Golden values below are computed by hand (see the comments), never by the code under test.
"""

from __future__ import annotations

import pytest
import torch
from ascend_cases import (
    ACT_MAX,
    ACT_MIN,
    GOLDEN_Q_BYTES,
    GOLDEN_SCALE_BYTES,
    GOLDEN_W,
    bf16_weights,
)

from hetquant.formats import FORMATS, HetquantError, get_format
from hetquant.formats import w8a8_npu as w8

DYN = get_format("w8a8_dynamic")
STATIC = get_format("w8a8")


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


@pytest.mark.parametrize("fmt", [DYN, STATIC], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 130), (576, 9)])
def test_stored_matches_quantize(fmt, shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t = fmt.quantize(weight, act_min=-2.0, act_max=3.0) if fmt is STATIC else fmt.quantize(weight)
    fmt.check_stored(t, shape)
    assert fmt.nbytes(shape) == sum(v.numel() * v.element_size() for v in t.values())


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


def test_static_scales_held_and_deq_scale_exact() -> None:
    t = STATIC.quantize(bf16_weights(6), act_min=-3.3, act_max=7.1)
    s_x, s_w = t["input_scale"], t["weight_scale"]
    for s in (s_x, s_w):
        assert torch.equal(s.to(torch.bfloat16).float(), s)
    assert float(s_x) >= (7.1 + 3.3) / 255  # rounded up: the range fits in 255 steps
    assert torch.equal(t["deq_scale"].double(), s_x.double() * s_w.double().squeeze(1))
    assert torch.equal(t["input_offset"], torch.round(3.3 / s_x.double()).float() - 128)


def test_reexports_are_the_parts_own() -> None:
    """What was imported from ``formats.w8a8_npu`` before it was split still is, unchanged."""
    from hetquant.formats import ascend_description, w8a8_npu_ops, w8a8_npu_rows

    for part in (ascend_description, w8a8_npu_ops, w8a8_npu_rows):
        for name in set(part.__all__) & set(w8.__all__):
            assert getattr(w8, name) is getattr(part, name), name
    moved = {"INT8_MAX", "INT8_MIN", "SCALE_FLOOR", "QUANT_TYPE_FLOAT", "dynamic_quant"}
    moved |= {"dynamic_quant_matmul", "static_quant_matmul", "description_entries"}
    assert moved | {"description_header", "held_scale", "activation_qparams"} <= set(w8.__all__)
