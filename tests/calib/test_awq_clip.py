"""calib/awq_clip.py: the clip search never scores worse than no clip, per group or per row, and
its row batches change nothing."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib.awq_clip import (
    CLIP_BATCH_BYTES,
    apply_clip,
    clip_bounds,
    clip_factors,
    clip_rows_per_batch,
    search_clip,
)
from hetquant.calib.awq_quant import fake_quantize
from hetquant.calib.quantizer import quantizer_for


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _awq(group: int):
    return quantizer_for("awq_w4a16", {"group_size": group})


def test_search_clip_never_worse_per_group():
    w = torch.randn(64, 256, generator=_gen(10))
    w[:, 5] *= 8  # a weight outlier per row: clipping it pays
    x = torch.randn(100, 256, generator=_gen(11))
    shrink = search_clip(w, x, _awq(128))
    assert shrink.dtype == torch.uint8 and shrink.shape == (64, 2)
    assert int(shrink.max()) < 10 and bool(shrink.any())
    factors = clip_factors(20, 0.5)
    clipped = apply_clip(w, clip_bounds(w, shrink, 128, factors), 128)

    def group_err(wc):
        d = (fake_quantize(wc, 128) - w).reshape(64, 2, 128)
        return torch.einsum("tgj,ngj->ntg", x.reshape(100, 2, 128), d).pow(2).mean(1)

    assert bool((group_err(clipped) <= group_err(w) + 1e-6).all())
    assert float(group_err(clipped).sum()) < 0.95 * float(group_err(w).sum())
    assert not search_clip(w, x[:0], _awq(128)).any()  # no tokens: no clip


def test_per_channel_clip_is_per_row():
    """For a per-channel format the clip group is the whole row: one shrink step per row, and
    the chosen clip never scores worse than none on the row's output error."""
    w = torch.randn(64, 256, generator=_gen(17))
    w[:, 5] *= 8
    x = torch.randn(100, 256, generator=_gen(18))
    q = quantizer_for("int4_cpu", {})
    shrink = search_clip(w, x, q)
    assert shrink.shape == (64, 1) and bool(shrink.any())
    bounds = clip_bounds(w, shrink, 256, clip_factors(20, 0.5))
    clipped = apply_clip(w, bounds, 256)

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
    small = search_clip(w, x, q, rows_per_batch=256)  # 3 batches, the last partial
    whole = search_clip(w, x, q, rows_per_batch=600)
    assert bool(small.any())
    assert torch.equal(small, whole)


def test_clip_rows_per_batch():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert clip_rows_per_batch(cpu, 7168, 56, 512) == 256  # AutoAWQ's, the CPU's bytes
    rows = clip_rows_per_batch(meta, 7168, 56, 512)  # an accelerator: by working set
    assert (
        rows * 4 * (56 * 512 + 4 * 7168)
        <= CLIP_BATCH_BYTES
        < (rows + 1) * 4 * (56 * 512 + 4 * 7168)
    )
    assert clip_rows_per_batch(meta, 1 << 20, 8192, 1 << 16) == 256  # at least 256
