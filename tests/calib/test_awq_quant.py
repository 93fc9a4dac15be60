"""calib/awq_quant.py: the fake quantizers are the formats' own round trips, and the RTN
parameters reproduce the stored bytes."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib.awq_quant import fake_quantize, fake_quantize_symmetric, rtn_params
from hetquant.formats.awq_w4a16 import AwqW4A16
from hetquant.formats.ct_pack_quantized import CtPackQuantized


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("case", ["normal", "tiny", "huge", "one_signed", "zeros"])
def test_fake_quantize_symmetric_is_the_ct_formats_round_trip(group, case):
    w = torch.randn(48, 256, generator=_gen(group + 1))
    w = {"normal": w, "tiny": w * 1e-30, "huge": w * 1e3, "one_signed": w.abs() + 0.5,
         "zeros": w * (torch.arange(256) >= 128)}[case]  # fmt: skip
    for dtype, name in ((torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")):
        fmt = CtPackQuantized(group, scale_dtype=name)
        got = fake_quantize_symmetric(w, group, dtype)
        assert torch.equal(got, fmt.dequantize(fmt.quantize(w)))


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("case", ["normal", "tiny", "huge", "one_signed", "zeros"])
def test_fake_quantize_is_the_formats_round_trip(group, case):
    w = torch.randn(48, 256, generator=_gen(group))
    w = {
        "normal": w,
        "tiny": w * 1e-6,
        "huge": w * 1e3,
        "one_signed": w.abs() + 0.5,
        "zeros": w * (torch.arange(256) >= 128),  # an all-zero group per row
    }[case]
    fmt = AwqW4A16(group)
    stored = fmt.quantize(w)
    assert torch.equal(fake_quantize(w, group), fmt.dequantize(stored))
    scales, zeros = rtn_params(w, group)
    again = fmt.quantize(w, scales=scales, zeros=zeros)
    assert all(torch.equal(again[k], stored[k]) for k in stored)
