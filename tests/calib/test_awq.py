"""The pure AWQ functions: the quantizer is the artifact's, the searches do what they say."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib import awq
from hetquant.calib.quantizer import quantizer_for
from hetquant.formats import HetquantError
from hetquant.formats.awq_w4a16 import AwqW4A16
from hetquant.formats.ct_pack_quantized import CtPackQuantized
from hetquant.runtime.forward.model import rms_norm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _awq(group: int):
    return quantizer_for("awq_w4a16", {"group_size": group})


@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("case", ["normal", "tiny", "huge", "one_signed", "zeros"])
def test_fake_quantize_symmetric_is_the_ct_formats_round_trip(group, case):
    w = torch.randn(48, 256, generator=_gen(group + 1))
    w = {"normal": w, "tiny": w * 1e-30, "huge": w * 1e3, "one_signed": w.abs() + 0.5,
         "zeros": w * (torch.arange(256) >= 128)}[case]  # fmt: skip
    for dtype, name in ((torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")):
        fmt = CtPackQuantized(group, scale_dtype=name)
        got = awq.fake_quantize_symmetric(w, group, dtype)
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
    assert torch.equal(awq.fake_quantize(w, group), fmt.dequantize(stored))
    scales, zeros = awq.rtn_params(w, group)
    again = fmt.quantize(w, scales=scales, zeros=zeros)
    assert all(torch.equal(again[k], stored[k]) for k in stored)


def test_candidates_identity_first_and_pow2():
    xm = torch.rand(256, generator=_gen(0)) + 0.01
    wm = torch.rand(256, generator=_gen(1)) + 0.01
    cands = awq.scale_candidates(xm, wm, 20, pow2=True)
    assert cands[0][0] is None and torch.equal(cands[0][1], torch.ones(256))
    for _, s in cands:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    plain = awq.scale_candidates(xm, wm, 20)
    assert len(plain) == 21  # identity + α = 0, 0.05, …, 0.95
    for _, s in plain[1:]:  # AutoAWQ's normalisation: max · min = 1, up to the rounding to
        # SCALE_BITS significant bits (≤ 2^-12 relative on each of the two)
        assert float(s.max() * s.min()) == pytest.approx(1.0, rel=2**-11)
        m, _ = torch.frexp(s.double())
        assert torch.equal(torch.ldexp(m, torch.tensor(awq.SCALE_BITS)).frac(), torch.zeros(256))


def test_significant_bits_round_to_nearest_even():
    x = torch.tensor([1.0, 1 + 2**-12, 1 + 2**-13, 1 + 3 * 2**-13, 3.0, 0.75 + 2**-40, 1e-4])
    got = awq._significant(x.double(), 12)
    assert got.dtype == torch.float32
    want = [1.0, 1.0, 1.0, 1 + 2**-11, 3.0, 0.75, None]  # 1 + 2^-12: a tie, to even
    for g, w in zip(got.tolist()[:-1], want[:-1], strict=True):
        assert g == w
    assert abs(got[-1].item() / 1e-4 - 1) <= 2**-12


def test_first_min_keeps_the_earlier_within_the_tolerance():
    assert awq.first_min([1.0, 1.0 - 1e-12, 0.5, 0.5 * (1 - 1e-10)]) == 2
    assert awq.first_min([1.0, 1.0 - 1e-6]) == 1
    assert awq.first_min([2.0, 1.0, 1.0]) == 1


def _objective(ws, xs, s, g):
    """The docstring's objective, computed the direct way, in float64."""
    num = den = 0.0
    for w, x in zip(ws, xs, strict=True):
        wq = awq.fake_quantize(w * s, g).double()
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
    found = awq.search_scale([w1, w2], x, [_awq(128)] * 2)
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
    found = awq.search_scale([w1, w2], [x, x[:0]], [_awq(128)] * 2, x_mean=awq.activation_mean(x))
    # the expert that saw no token adds nothing: the loss is w1's alone
    assert found.loss == pytest.approx(_objective([w1], [x], found.scales, 128), rel=1e-4)
    assert found.loss <= found.identity_loss


def test_identity_wins_on_isotropic_data():
    x = torch.randn(200, 128, generator=_gen(8))
    w = torch.randn(32, 128, generator=_gen(9))
    found = awq.search_scale([w], x, [_awq(128)])
    assert found.loss <= found.identity_loss  # never worse than round-to-nearest


def test_search_clip_never_worse_per_group():
    w = torch.randn(64, 256, generator=_gen(10))
    w[:, 5] *= 8  # a weight outlier per row: clipping it pays
    x = torch.randn(100, 256, generator=_gen(11))
    shrink = awq.search_clip(w, x, _awq(128))
    assert shrink.dtype == torch.uint8 and shrink.shape == (64, 2)
    assert int(shrink.max()) < 10 and bool(shrink.any())
    factors = awq.clip_factors(20, 0.5)
    clipped = awq.apply_clip(w, awq.clip_bounds(w, shrink, 128, factors), 128)

    def group_err(wc):
        d = (awq.fake_quantize(wc, 128) - w).reshape(64, 2, 128)
        return torch.einsum("tgj,ngj->ntg", x.reshape(100, 2, 128), d).pow(2).mean(1)

    assert bool((group_err(clipped) <= group_err(w) + 1e-6).all())
    assert float(group_err(clipped).sum()) < 0.95 * float(group_err(w).sum())
    assert not awq.search_clip(w, x[:0], _awq(128)).any()  # no tokens: no clip


def test_folds_are_the_identity_on_the_float_model():
    torch.manual_seed(0)
    h = torch.randn(10, 256, dtype=torch.float64)
    norm = torch.rand(256, dtype=torch.float64) + 0.5
    w = torch.randn(32, 256, dtype=torch.float64)
    s = torch.rand(256, dtype=torch.float64) + 0.1
    ref = rms_norm(h, norm, 1e-6).double() @ w.T
    folded = rms_norm(h, awq.fold_into_norm(norm, s).double(), 1e-6).double()
    got = folded @ awq.scale_columns(w, s).double().T
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)  # float32 folds, float64 compute
    # a previous linear's rows: y = (x A^T) with rows ÷ s, then W·diag(s)
    a = torch.randn(256, 64, dtype=torch.float64)
    x = torch.randn(5, 64, dtype=torch.float64)
    y = x @ awq.fold_into_linear(a, s).double().T @ awq.scale_columns(w, s).double().T
    assert torch.allclose(y, x @ a.T @ w.T, rtol=1e-5, atol=1e-5)
    rows = torch.arange(0, 256, 2)
    a2 = awq.fold_into_linear(a, s[:128], rows)
    assert torch.equal(a2[1::2], a[1::2]) and torch.allclose(a2[::2], a[::2] / s[:128, None])


def test_gram_and_direct_paths_agree():
    x = torch.randn(600, 128, generator=_gen(12))
    err = torch.randn(16, 128, generator=_gen(13)) * 1e-2
    direct = float(awq._sq_out(x, err, None, torch.float32))
    gram = float(awq._sq_out(x, err, awq._gram(x, torch.float32), torch.float32))
    assert gram == pytest.approx(direct, rel=1e-4)


def test_float_linears_in_a_mapping_add_no_error():
    """A linear kept in float (quantizer None) is folded with the others but scored as exact:
    the search equals the one over the quantized linears alone, and needs one of those."""
    x = torch.randn(300, 256, generator=_gen(14))
    x[:, ::32] *= 30
    w1, w2 = torch.randn(64, 256, generator=_gen(15)), torch.randn(32, 256, generator=_gen(16))
    q = quantizer_for("int4_cpu", {})
    mixed = awq.search_scale([w1, w2], x, [q, None])
    alone = awq.search_scale([w1], x, [q])
    assert mixed.losses == alone.losses and torch.equal(mixed.scales, alone.scales)
    with pytest.raises(HetquantError, match="no quantized weight"):
        awq.search_scale([w1, w2], x, [None, None])


def test_per_channel_clip_is_per_row():
    """For a per-channel format the clip group is the whole row: one shrink step per row, and
    the chosen clip never scores worse than none on the row's output error."""
    w = torch.randn(64, 256, generator=_gen(17))
    w[:, 5] *= 8
    x = torch.randn(100, 256, generator=_gen(18))
    q = quantizer_for("int4_cpu", {})
    shrink = awq.search_clip(w, x, q)
    assert shrink.shape == (64, 1) and bool(shrink.any())
    bounds = awq.clip_bounds(w, shrink, 256, awq.clip_factors(20, 0.5))
    clipped = awq.apply_clip(w, bounds, 256)

    def row_err(wc):
        return (x @ (q(wc) - w).T).pow(2).mean(0)  # [N]

    assert bool((row_err(clipped) <= row_err(w) * (1 + 1e-6)).all())
    assert float(row_err(clipped).sum()) < float(row_err(w).sum())


@pytest.mark.parametrize("fmt", ["awq_w4a16", "int4_cpu"])
def test_search_clip_row_batches_do_not_change_the_choice(fmt):
    """Rows are searched independently: batching them (256 on the CPU, whole weights on an
    accelerator: ``clip_rows_per_batch``) picks the same shrink steps up to float ties, for a
    group-wise and a per-channel quantizer."""
    w = torch.randn(600, 256, generator=_gen(14))
    w[:, 7] *= 6
    x = torch.randn(120, 256, generator=_gen(15))
    q = _awq(128) if fmt == "awq_w4a16" else quantizer_for(fmt, {})
    small = awq.search_clip(w, x, q, rows_per_batch=256)  # 3 batches, the last partial
    whole = awq.search_clip(w, x, q, rows_per_batch=600)
    assert bool(small.any())
    assert torch.equal(small, whole)


def test_clip_rows_per_batch():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert awq.clip_rows_per_batch(cpu, 7168, 56, 512) == 256  # AutoAWQ's, the CPU's bytes
    rows = awq.clip_rows_per_batch(meta, 7168, 56, 512)  # an accelerator: by working set
    assert (
        rows * 4 * (56 * 512 + 4 * 7168)
        <= awq.CLIP_BATCH_BYTES
        < (rows + 1) * 4 * (56 * 512 + 4 * 7168)
    )
    assert awq.clip_rows_per_batch(meta, 1 << 20, 8192, 1 << 16) == 256  # at least 256
