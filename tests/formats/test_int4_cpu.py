"""Tests of formats/int4_cpu.py: the registered formats' golden bytes, shapes and refused inputs.

The row codec and the layer layout have their own files (test_int4_cpu_rows.py,
test_int4_cpu_layer.py)."""

from __future__ import annotations

import struct

import pytest
import torch

from hetquant.formats import HetquantError, TensorMeta, get_format
from hetquant.formats.int4_cpu import Int4Cpu, layer_stored

FMT = Int4Cpu()


def _f32le(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


# --- golden bytes --------------------------------------------------------------------------------


def test_golden_bytes_per_linear() -> None:
    w = torch.tensor([[7.0, -7.0, 1.0, 0.5], [14.0, -3.0, 2.5, -13.0], [0.0, 0.0, 0.0, 0.0]])
    t = FMT.quantize(w)
    # row 0: s = 7/7 = 1, q = 7 -7 1 0 (0.5 → 0, half to even), c = q + 8 = 15 1 9 8
    # row 1: s = 14/7 = 2, w/s = 7 -1.5 1.25 -6.5 → q = 7 -2 1 -6 → c = 15 6 9 2
    # row 2: all zero → s = 1, c = 8 8 8 8;   byte j = c[2j] | c[2j+1] << 4
    assert t["weight_packed"].numpy().tobytes() == bytes([0x1F, 0x89, 0x6F, 0x29, 0x88, 0x88])
    assert t["weight_scale"].numpy().tobytes() == _f32le(1.0, 2.0, 1.0)
    want = torch.tensor([[7.0, -7.0, 1.0, 0.0], [14.0, -4.0, 2.0, -12.0], [0.0] * 4])
    assert torch.equal(FMT.dequantize(t), want)


def test_registry_and_shapes() -> None:
    assert get_format("int4_cpu") == FMT
    assert FMT.stored((7168, 2048)) == {
        "weight_packed": TensorMeta("U8", (7168, 1024)),
        "weight_scale": TensorMeta("F32", (7168,)),
    }
    assert FMT.nbytes((7168, 2048)) == 7168 * 1024 + 4 * 7168  # = kt's n·k/2 + 4n (§1.2c)
    assert FMT.bits_per_weight((4, 64)) == 4 + 32 / 64
    metas = layer_stored(256, 7168, 2048)
    assert sum(m.nbytes for m in metas.values()) == 256 * 22_065_152  # kt, threadpool 1
    assert metas["gate_up_packed"].shape == (256, 4096, 3584)
    assert metas["down_packed"].shape == (256, 7168, 1024)


# --- refused inputs ------------------------------------------------------------------------------


def _nan(w: torch.Tensor, value: float) -> torch.Tensor:
    w = w.clone()
    w[1, 2] = value
    return w


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: FMT.stored((4, 7)), id="stored-odd-in"),
        pytest.param(lambda: FMT.quantize(torch.ones(4, 7)), id="quantize-odd-in"),
        pytest.param(lambda: FMT.quantize(torch.ones(4, 0)), id="quantize-empty-in"),
        pytest.param(lambda: FMT.quantize(torch.ones(2, 4, 4)), id="quantize-3d"),
        pytest.param(lambda: FMT.quantize(_nan(torch.ones(4, 8), float("nan"))), id="nan"),
        pytest.param(lambda: FMT.quantize(_nan(torch.ones(4, 8), float("inf"))), id="inf"),
        pytest.param(lambda: FMT.quantize(torch.ones(4, 8), group_size=32), id="bad-option"),
        pytest.param(
            lambda: FMT.dequantize(
                {
                    "weight_packed": torch.zeros(2, 4, dtype=torch.uint8),
                    "weight_scale": torch.zeros(3),
                }
            ),
            id="dequantize-scale-shape",
        ),
        pytest.param(
            lambda: FMT.dequantize(
                {
                    "weight_packed": torch.zeros(2, 4, dtype=torch.uint8),
                    "weight_scale": torch.tensor([1.0, float("nan")]),
                }
            ),
            id="dequantize-nan-scale",
        ),
    ],
)
def test_bad_inputs_refused(call) -> None:
    with pytest.raises(HetquantError):
        call()


def test_reexports_are_the_parts_own() -> None:
    """What was imported from ``formats.int4_cpu`` before it was split still is, unchanged."""
    from hetquant.formats import int4_cpu, int4_cpu_layer, int4_cpu_rows

    for part in (int4_cpu_layer, int4_cpu_rows):
        for name in set(part.__all__) & set(int4_cpu.__all__):
            assert getattr(int4_cpu, name) is getattr(part, name), name
    assert set(int4_cpu_layer.__all__) - {"decode_expert"} <= set(int4_cpu.__all__)
    assert {"CLIP_RATIOS", "QMAX", "ZERO_POINT", "dequantize_rows"} <= set(int4_cpu.__all__)
