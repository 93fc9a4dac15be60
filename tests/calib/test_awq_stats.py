"""calib/awq_stats.py: the statistics the AWQ candidates are built from, and the two ways of
scoring an output error."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib.awq_stats import activation_mean, gram_matrix, sq_out, weight_mean
from hetquant.formats import HetquantError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_gram_and_direct_paths_agree():
    x = torch.randn(600, 128, generator=_gen(12))
    err = torch.randn(16, 128, generator=_gen(13)) * 1e-2
    direct = float(sq_out(x, err, None, torch.float32))
    gram = float(sq_out(x, err, gram_matrix(x, torch.float32), torch.float32))
    assert gram == pytest.approx(direct, rel=1e-4)


def test_activation_mean_over_several_inputs():
    a = torch.randn(7, 3, 16, generator=_gen(20))
    b = torch.randn(5, 16, generator=_gen(21))
    got = activation_mean([a, b])
    want = torch.cat([a.reshape(-1, 16), b]).double().abs().mean(0)
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12)
    assert torch.equal(activation_mean(b), activation_mean([b]))


def test_weight_mean_is_relative_to_each_group():
    w1 = torch.tensor([[1.0, -2.0, 4.0, 0.0]])  # groups of 2: max 2, then 4
    w2 = torch.tensor([[0.0, 0.0, -3.0, 3.0], [1.0, 1.0, 1.0, 1.0]])  # one group of 4
    got = weight_mean([w1, w2], [2, 4])
    rel1 = [1 / (2 + 1e-6), 2 / (2 + 1e-6), 4 / (4 + 1e-6), 0.0]
    rel2 = [[0.0, 0.0, 3 / (3 + 1e-6), 3 / (3 + 1e-6)], [1 / (1 + 1e-6)] * 4]
    want = (torch.tensor(rel1) + torch.tensor(rel2).sum(0)).double() / 3
    assert torch.allclose(got, want, rtol=1e-6)
    with pytest.raises(HetquantError, match="no weights"):
        weight_mean([], [])
