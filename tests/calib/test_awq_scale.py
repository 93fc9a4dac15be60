"""calib/awq_scale.py: the scale candidates, the tie rule, and the search against the
documented objective."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib.awq_quant import fake_quantize
from hetquant.calib.awq_scale import (
    SCALE_BITS,
    _significant,
    first_min,
    scale_candidates,
    search_scale,
)
from hetquant.calib.awq_stats import activation_mean
from hetquant.calib.quantizer import quantizer_for
from hetquant.formats import HetquantError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _awq(group: int):
    return quantizer_for("awq_w4a16", {"group_size": group})


def test_candidates_identity_first_and_pow2():
    xm = torch.rand(256, generator=_gen(0)) + 0.01
    wm = torch.rand(256, generator=_gen(1)) + 0.01
    cands = scale_candidates(xm, wm, 20, pow2=True)
    assert cands[0][0] is None and torch.equal(cands[0][1], torch.ones(256))
    for _, s in cands:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    plain = scale_candidates(xm, wm, 20)
    assert len(plain) == 21  # identity + α = 0, 0.05, …, 0.95
    for _, s in plain[1:]:  # AutoAWQ's normalisation: max · min = 1, up to the rounding to
        # SCALE_BITS significant bits (≤ 2^-12 relative on each of the two)
        assert float(s.max() * s.min()) == pytest.approx(1.0, rel=2**-11)
        m, _ = torch.frexp(s.double())
        assert torch.equal(torch.ldexp(m, torch.tensor(SCALE_BITS)).frac(), torch.zeros(256))


def test_significant_bits_round_to_nearest_even():
    x = torch.tensor([1.0, 1 + 2**-12, 1 + 2**-13, 1 + 3 * 2**-13, 3.0, 0.75 + 2**-40, 1e-4])
    got = _significant(x.double(), 12)
    assert got.dtype == torch.float32
    want = [1.0, 1.0, 1.0, 1 + 2**-11, 3.0, 0.75, None]  # 1 + 2^-12: a tie, to even
    for g, w in zip(got.tolist()[:-1], want[:-1], strict=True):
        assert g == w
    assert abs(got[-1].item() / 1e-4 - 1) <= 2**-12


def test_first_min_keeps_the_earlier_within_the_tolerance():
    assert first_min([1.0, 1.0 - 1e-12, 0.5, 0.5 * (1 - 1e-10)]) == 2
    assert first_min([1.0, 1.0 - 1e-6]) == 1
    assert first_min([2.0, 1.0, 1.0]) == 1


def _objective(ws, xs, s, g):
    """The docstring's objective, computed the direct way, in float64."""
    num = den = 0.0
    for w, x in zip(ws, xs, strict=True):
        wq = fake_quantize(w * s, g).double()
        out = (x.double() / s.double()) @ wq.T
        ref = x.double() @ w.double().T
        num += float((out - ref).pow(2).sum())
        den += out.numel()
    return num / den


def test_search_scale_protects_outlier_channels():
    x = torch.randn(300, 256, generator=_gen(2))
    x[:, ::32] *= 30  # salient input channels
    w1 = torch.randn(64, 256, generator=_gen(3))
    w2 = torch.randn(32, 256, generator=_gen(4))
    found = search_scale([w1, w2], x, [_awq(128)] * 2)
    assert found.ratio is not None
    assert found.loss < 0.8 * found.identity_loss
    assert found.losses[0] == (None, found.identity_loss)
    assert found.loss == min(v for _, v in found.losses)
    # the reported loss is the documented objective (T = 300 > K: the Gram path)
    assert found.loss == pytest.approx(_objective([w1, w2], [x, x], found.scales, 128), rel=1e-4)
    assert found.identity_loss == pytest.approx(
        _objective([w1, w2], [x, x], torch.ones(256), 128), rel=1e-4
    )


def test_search_scale_per_weight_inputs_and_empty():
    x = torch.randn(40, 256, generator=_gen(5))  # T < K: the direct path
    x[:, :8] *= 10
    w1, w2 = torch.randn(16, 256, generator=_gen(6)), torch.randn(16, 256, generator=_gen(7))
    found = search_scale([w1, w2], [x, x[:0]], [_awq(128)] * 2, x_mean=activation_mean(x))
    # the expert that saw no token adds nothing: the loss is w1's alone
    assert found.loss == pytest.approx(_objective([w1], [x], found.scales, 128), rel=1e-4)
    assert found.loss <= found.identity_loss


def test_identity_wins_on_isotropic_data():
    x = torch.randn(200, 128, generator=_gen(8))
    w = torch.randn(32, 128, generator=_gen(9))
    found = search_scale([w], x, [_awq(128)])
    assert found.loss <= found.identity_loss  # never worse than round-to-nearest


def test_float_linears_in_a_mapping_add_no_error():
    """A linear kept in float (quantizer None) is folded with the others but scored as exact:
    the search equals the one over the quantized linears alone, and needs one of those."""
    x = torch.randn(300, 256, generator=_gen(14))
    x[:, ::32] *= 30
    w1, w2 = torch.randn(64, 256, generator=_gen(15)), torch.randn(32, 256, generator=_gen(16))
    q = quantizer_for("int4_cpu", {})
    mixed = search_scale([w1, w2], x, [q, None])
    alone = search_scale([w1], x, [q])
    assert mixed.losses == alone.losses and torch.equal(mixed.scales, alone.scales)
    with pytest.raises(HetquantError, match="no quantized weight"):
        search_scale([w1, w2], x, [None, None])
