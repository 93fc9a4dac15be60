"""GPTQ error feedback (``calib/gptq.py``): it lowers the layer's output error where inputs are
correlated, reduces to round-to-nearest where they are not, and its codes are stored exactly by
the format's own round-to-nearest (the converter's path); refusals."""

from __future__ import annotations

import pytest
import torch
from calib_consts import weight_zoo

from hetquant.calib import AwqOptions, calibrate
from hetquant.calib.gptq import GRIDS, gptq, hessian
from hetquant.calib.quantizer import quantizer_for
from hetquant.calib.transforms import Transform, apply_transform
from hetquant.formats import HetquantError, get_format
from hetquant.formats.bits import unpack_nibbles_u8

FORMATS = [("int4_cpu", {})] + [("int4_cpu_group", {"group_size": g}) for g in (32, 64, 128)]
ZERO_POINT = 8


def _problem(seed: int, n: int = 96, k: int = 256, t: int = 2048):
    """(W [n, k], X [t, k]): inputs of rank 24 plus 5% noise, one channel ×10 — the
    correlations GPTQ exploits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 24, generator=g) @ torch.randn(24, k, generator=g)
    x += 0.05 * torch.randn(t, k, generator=g)
    x[:, 5] *= 10
    return torch.randn(n, k, generator=g), x


def _out_err(x: torch.Tensor, wq: torch.Tensor, w: torch.Tensor) -> float:
    return float((x.double() @ (wq - w).double().T).pow(2).mean())


@pytest.mark.parametrize(("fmt", "params"), FORMATS, ids=str)
def test_gptq_lowers_the_output_error_of_correlated_inputs(fmt: str, params: dict) -> None:
    q = quantizer_for(fmt, params)
    for seed in (0, 1):
        w, x = _problem(seed)
        found = gptq("w", w, w, hessian(x, w.shape[1]), q)
        assert _out_err(x, found.weight(), w) < 0.25 * _out_err(x, q(w), w)


@pytest.mark.parametrize(("fmt", "params"), FORMATS, ids=str)
def test_uncorrelated_inputs_give_round_to_nearest(fmt: str, params: dict) -> None:
    """H ∝ I: no error is fed back (U is diagonal), every code is round-to-nearest's."""
    q = quantizer_for(fmt, params)
    for w in weight_zoo(2, (64, 256)):
        h = torch.eye(256) * 3.0
        assert torch.equal(gptq("w", w, w, h, q).weight(), q(w))


@pytest.mark.parametrize(("fmt", "params"), FORMATS, ids=str)
def test_codes_are_stored_exactly_by_the_formats_rounding(fmt: str, params: dict) -> None:
    """``quantize(codes · scale)`` holds those codes and scales bit for bit (the converter's
    path), also with clipped grids and with dead input channels."""
    real = get_format(fmt, **params)
    q = quantizer_for(fmt, params)
    _, x = _problem(3, k=256)
    x[:, 7] = 0  # a dead input channel
    h = hessian(x, 256)
    for w in weight_zoo(4, (64, 256)):
        for shrink in (0, 3):
            g = q.group(256)
            factors = torch.tensor([1.0, 0.95, 0.9, 0.85])
            t = Transform(shrink=torch.full((64, 256 // g), shrink, dtype=torch.uint8))
            clipped = apply_transform(w, t, factors)
            found = gptq("w", w, clipped, h, q)
            assert found.codes.dtype == torch.int8
            assert int(found.codes.abs().max()) <= GRIDS[fmt]
            stored = real.quantize(found.weight())
            codes = unpack_nibbles_u8(stored["weight_packed"]).to(torch.int16) - ZERO_POINT
            assert torch.equal(codes, found.codes.to(torch.int16))
            assert torch.equal(stored["weight_scale"].float().reshape(64, -1), found.scale)


def test_transform_with_codes_applies_and_slices_rows() -> None:
    q = quantizer_for("int4_cpu_group", {"group_size": 32})
    w, x = _problem(5, n=16, k=64)
    found = gptq("w", w, w, hessian(x, 64), q)
    t = Transform(col_mul=torch.full((64,), 2.0), codes=found.codes, qscale=found.scale)
    one = torch.ones(1)
    assert torch.equal(apply_transform(w, t, one), found.weight())
    assert torch.equal(apply_transform(w[4:9], t, one, row0=4), found.weight()[4:9])
    assert set(t.tensors()) == {"col_mul", "codes", "qscale"}


def test_refusals() -> None:
    w, x = _problem(6, n=8, k=128)
    with pytest.raises(HetquantError, match="awq_w4a16 has no symmetric"):
        gptq("layers.0.w", w, w, hessian(x, 128), quantizer_for("awq_w4a16", {"group_size": 64}))
    with pytest.raises(HetquantError, match="gptq_damp 0"):
        AwqOptions(gptq_damp=0)


def test_calibrate_refuses_gptq_for_formats_without_a_grid(tiny_source, calib_tokens) -> None:
    """awq-w4a16's default targets (asymmetric, zero points) have no q·s grid: GPTQ would do
    nothing; refused naming the first tensor and the format before any layer is calibrated."""
    with pytest.raises(HetquantError, match=r"model\.layers\.0\..*\['awq_w4a16'\]\) has a"):
        calibrate(tiny_source, calib_tokens[:1], AwqOptions(gptq=True), device="cpu")
