"""The calibration seam: ``Q`` of every calibrated format is that format's quantize → dequantize,
bit for bit (fast paths and expert layouts included), and its clip group is the format's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from calib_consts import weight_zoo

from hetquant.calib.quantizer import FAST_PATHS, Quantizer, quantizer_for
from hetquant.formats import (
    EXPERT_FORMATS,
    HetquantError,
    fp4_cpu,
    get_format,
    int4_cpu,
    int4_cpu_group,
)

# every (format, params) a recipe calibrates today, and the awq group sizes
CALIBRATED = [
    ("awq_w4a16", {"group_size": 128}),
    ("awq_w4a16", {"group_size": 64}),
    ("ct_pack_quantized", {"group_size": 32}),
    ("ct_pack_quantized", {"group_size": 128}),
    ("ct_pack_quantized", {"group_size": 32, "scale_dtype": "F16"}),
    ("ct_pack_quantized", {"group_size": 32, "scale_dtype": "F32"}),
    ("ct_pack_quantized", {"group_size": 32, "shape_dtype": "I32"}),  # ascend-w4a16's
    ("w8a8_dynamic", {}),
    ("w4a8_dynamic", {}),  # ascend-w4a8's: gate/up
    ("w4a8_dynamic", {"bias_chunks": 16}),  # down
    ("int4_cpu", {}),
    ("int4_cpu_group", {"group_size": 32}),
    ("int4_cpu_group", {"group_size": 64}),
    ("int4_cpu_group", {"group_size": 128}),
]
# each expert-layer format's own reading of its stacked layout
LAYOUTS = {
    "int4_cpu_experts": (int4_cpu.stack_experts, int4_cpu.dequantize_expert),
    "int4_cpu_group_experts": (int4_cpu_group.stack_experts, int4_cpu_group.dequantize_expert),
    "fp4_cpu_experts": (fp4_cpu.stack_experts, fp4_cpu.dequantize_expert),
}


@pytest.mark.parametrize(("fmt", "params"), CALIBRATED, ids=lambda v: str(v))
def test_fake_quantize_is_the_formats_round_trip(fmt: str, params: dict) -> None:
    q = quantizer_for(fmt, params)
    real = get_format(fmt, **params)
    assert q.fmt == real
    for w in weight_zoo(1, (64, 256)):
        for x in (w, w.to(torch.bfloat16)):  # the source dtype or calibration's float32
            got = q(x)
            assert got.dtype == torch.float32
            assert torch.equal(got, real.dequantize(real.quantize(x)))


def test_every_fast_path_is_covered() -> None:
    assert set(FAST_PATHS) <= {f for f, _ in CALIBRATED}


@pytest.mark.parametrize(
    ("name", "params"),
    [("int4_cpu_experts", {})]
    + [("int4_cpu_group_experts", {"group_size": g}) for g in int4_cpu_group.GROUP_SIZES],
    ids=str,
)
def test_expert_layout_is_its_linear_formats_round_trip(name: str, params: dict) -> None:
    layout = dataclasses.replace(EXPERT_FORMATS[name], **params)
    q = quantizer_for(name, params)
    assert q == Quantizer(layout.linear_format())
    stack, dequantize = LAYOUTS[name]
    experts = []
    for e, (gate, down) in enumerate(
        zip(weight_zoo(2, (128, 256)), weight_zoo(3, (256, 128)), strict=True)
    ):
        up = torch.randn(128, 256, generator=torch.Generator().manual_seed(10 + e))
        experts.append((gate, up, down))
    layer = stack([layout.quantize_expert(*parts) for parts in experts])
    for e, parts in enumerate(experts):
        for got, w in zip(dequantize(layer, e), parts, strict=True):
            assert torch.equal(q(w), got)


def test_every_expert_format_is_checked() -> None:
    assert set(EXPERT_FORMATS) == set(LAYOUTS)


@pytest.mark.parametrize(
    ("fmt", "params", "group"),
    [("awq_w4a16", {"group_size": 64}, 64), ("int4_cpu", {}, 384), ("w8a8_dynamic", {}, 384),
     ("int4_cpu_group_experts", {"group_size": 32}, 32), ("int4_cpu_experts", {}, 384)],
)  # fmt: skip
def test_group_is_the_formats_scale_span(fmt: str, params: dict, group: int) -> None:
    assert quantizer_for(fmt, params).group(384) == group


def test_spec_round_trips_and_bad_targets() -> None:
    q = quantizer_for("int4_cpu_group_experts", {"group_size": 64})
    assert q.spec() == ["int4_cpu_group", {"group_size": 64}]
    assert quantizer_for(*q.spec()) == q
    with pytest.raises(HetquantError, match="unknown target format 'nope'"):
        quantizer_for("nope")
    with pytest.raises(HetquantError, match="cannot be calibrated"):
        quantizer_for("int4_cpu_experts", {"clip_search": True})
    with pytest.raises(HetquantError, match=r"layers\.0\.mlp\.down_proj\.weight: .*group size 32"):
        quantizer_for("int4_cpu_group", {"group_size": 32}).check(
            "layers.0.mlp.down_proj.weight", (64, 48)
        )
