"""The W8A8-aware scale search (``calib/smooth.py``): its activation quantizer is the runtime's,
its objective is what a W8A8_DYNAMIC linear computes, and on inputs with outlier channels it
beats the weight-only search on that objective (never worse than ``s = 1``)."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib import awq
from hetquant.calib.quantizer import quantizer_for
from hetquant.calib.smooth import act_aware_search, dynamic_fake_quant, smooth_candidates
from hetquant.formats import HetquantError, get_format
from hetquant.formats.w8a8_npu import dynamic_quant_matmul


def _outliers(seed: int, t: int = 1024, k: int = 128, n: int = 64):
    """(X [t, k] with 4 channels ×30, W [n, k])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, ::32] *= 30
    return x, torch.randn(n, k, generator=g) * 0.05


def _w8a8_err(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> float:
    """The runtime's W8A8_DYNAMIC output for ``x·diag(s)⁻¹`` and ``W·diag(s)`` against x·Wᵀ."""
    fmt = get_format("w8a8_dynamic")
    y = dynamic_quant_matmul(x / s, fmt.quantize(w * s))
    return float((y - x @ w.T).double().pow(2).mean())


def test_fake_quant_is_the_runtimes_dynamic_quant() -> None:
    x, w = _outliers(0)
    fmt = get_format("w8a8_dynamic")
    q = quantizer_for("w8a8_dynamic")
    want = dynamic_quant_matmul(x, fmt.quantize(w))
    got = dynamic_fake_quant(x) @ q(w).T
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_act_aware_search_beats_weight_only_on_the_w8a8_objective() -> None:
    q = quantizer_for("w8a8_dynamic")
    for seed in (1, 2):
        x, w = _outliers(seed)
        found = act_aware_search([w], x, [q])
        plain = awq.search_scale([w], x, [q])
        ones = torch.ones(x.shape[1])
        assert found.loss <= found.identity_loss
        assert _w8a8_err(x, w, found.scales) < 0.5 * _w8a8_err(x, w, ones)
        assert _w8a8_err(x, w, found.scales) < _w8a8_err(x, w, plain.scales)


def test_weight_only_linears_keep_awqs_objective() -> None:
    """A balance without an activation-quantized linear scores each candidate as AWQ does."""
    x, w = _outliers(3)
    q = quantizer_for("int4_cpu")
    found = act_aware_search([w], x, [q], n_tokens=x.shape[0])
    plain = dict(awq.search_scale([w], x, [q]).losses)
    for ratio, loss in found.losses:
        if ratio is None or ratio < 1:  # AWQ's candidates (SmoothQuant's: 1 + α)
            assert loss == pytest.approx(plain[ratio], rel=1e-4)


def test_smooth_candidates_and_refusals() -> None:
    cands = smooth_candidates(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 1.0]), 2)
    assert [a for a, _ in cands] == [0.0, 0.5, 1.0]
    assert torch.allclose(cands[2][1], torch.tensor([0.5, 2.0]))  # x_max, normalised
    with pytest.raises(HetquantError, match="no quantized weight"):
        act_aware_search([torch.ones(2, 4)], torch.ones(3, 4), [None])
