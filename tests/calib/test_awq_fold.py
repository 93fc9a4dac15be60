"""calib/awq_fold.py: folding a scale into the norm or the previous linear and its inverse into
the weights leaves the float model unchanged."""

from __future__ import annotations

import torch

from hetquant.calib.awq_fold import fold_into_linear, fold_into_norm, scale_columns
from hetquant.runtime.forward.model import rms_norm


def test_folds_are_the_identity_on_the_float_model():
    torch.manual_seed(0)
    h = torch.randn(10, 256, dtype=torch.float64)
    norm = torch.rand(256, dtype=torch.float64) + 0.5
    w = torch.randn(32, 256, dtype=torch.float64)
    s = torch.rand(256, dtype=torch.float64) + 0.1
    ref = rms_norm(h, norm, 1e-6).double() @ w.T
    folded = rms_norm(h, fold_into_norm(norm, s).double(), 1e-6).double()
    got = folded @ scale_columns(w, s).double().T
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)  # float32 folds, float64 compute
    # a previous linear's rows: y = (x A^T) with rows ÷ s, then W·diag(s)
    a = torch.randn(256, 64, dtype=torch.float64)
    x = torch.randn(5, 64, dtype=torch.float64)
    y = x @ fold_into_linear(a, s).double().T @ scale_columns(w, s).double().T
    assert torch.allclose(y, x @ a.T @ w.T, rtol=1e-5, atol=1e-5)
    rows = torch.arange(0, 256, 2)
    a2 = fold_into_linear(a, s[:128], rows)
    assert torch.equal(a2[1::2], a[1::2]) and torch.allclose(a2[::2], a[::2] / s[:128, None])
