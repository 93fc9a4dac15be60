"""Ascend W4A8_DYNAMIC (formats/w4a8_npu.py): golden bytes worked out by hand, msModelSlim's
packing and scale_bias re-implemented from its source, error bounds, shards, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ascend_cases import as_weight, float_weights
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import FORMATS, HetquantError, get_format
from hetquant.formats import w4a8_npu as w4

COL = get_format("w4a8_dynamic")  # gate/up: one scale_bias column
ROW = get_format("w4a8_dynamic", bias_chunks=16)  # down: 16 chunks

# Rows chosen so that rowmax / 7 is a power of two or zero (exact in F32); ties round to even.
#   row 0: amax 7    -> s = 1:     codes 7 -7 0 2 -2 3 -3 5 0 6 -6 5 -5 2 -1 1       (Σ 7)
#   row 1: amax 14   -> s = 2:     codes 7 0 2 -2 0 1 -1 2 -2 3 -3 4 -4 5 -5 6       (Σ 13)
#   row 2: all zero  -> s = 2^-23: codes 0
#   row 3: amax 7/16 -> s = 1/16:  codes 7 -7 0 2 -2 1 0 0 0 0 0 0 0 0 0 -4          (Σ -3)
GOLDEN_W = torch.tensor(
    [
        [7, -7, 0.5, 1.5, -2.5, 3, -3.49, 4.51, 0, 6, -6, 5, -5, 2, -1, 1],
        [14, 1, 3, -5, 0, 2, -2, 4, -4, 6, -6, 8, -8, 10, -10, 12],
        [0.0] * 16,
        [x / 16 for x in (7, -7, 0.5, 1.5, -2.5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, -4)],
    ]
)
GOLDEN_Q = [
    [7, -7, 0, 2, -2, 3, -3, 5, 0, 6, -6, 5, -5, 2, -1, 1],
    [7, 0, 2, -2, 0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6],
    [0] * 16,
    [7, -7, 0, 2, -2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, -4],
]
# byte [j, c] = (q[2j+1, c] << 4) | (q[2j, c] & 0xF): column 0 of rows 0/1 = 0x77, column 1 =
# 0x09 (-7 → 0x9 low, 0 high), column 3 = 0xE2 (2 low, -2 → 0xE high), …; rows 2/3 put row 3's
# codes in the high nibbles: 0x70 0x90 0x00 0x20 0xE0 0x10 0 … 0 0xC0.
GOLDEN_WEIGHT = bytes.fromhex("770920e20e13fd25e036da45cb52bf6170900020e010000000000000000000c0")
GOLDEN_SCALE = bytes.fromhex("0000803f00000040000000340000803d")  # 1, 2, 2^-23, 1/16
GOLDEN_BIAS_COL = [[56.0], [208.0], [0.0], [-1.5]]  # 8·Σq·s: 8·7·1, 8·13·2, 0, 8·(-3)/16


def test_registered() -> None:
    assert isinstance(FORMATS["w4a8_dynamic"], w4.W4A8Dynamic)


def test_golden_bytes() -> None:
    before = GOLDEN_W.clone()
    t = COL.quantize(GOLDEN_W)
    assert torch.equal(GOLDEN_W, before)  # pure
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "weight": (torch.int8, (2, 16)),
        "weight_scale": (torch.float32, (4, 1)),
        "weight_offset": (torch.float32, (4, 1)),
        "scale_bias": (torch.float32, (4, 1)),
    }
    assert t["weight"].numpy().tobytes() == GOLDEN_WEIGHT
    assert t["weight_scale"].numpy().tobytes() == GOLDEN_SCALE
    assert t["weight_offset"].numpy().tobytes() == bytes(16)
    assert t["scale_bias"].tolist() == GOLDEN_BIAS_COL
    assert w4.unpack_out_pairs(t["weight"]).tolist() == GOLDEN_Q
    s = torch.tensor([[1.0], [2.0], [2.0**-23], [1 / 16]])
    assert torch.equal(COL.dequantize(t), torch.tensor(GOLDEN_Q, dtype=torch.float32) * s)


def test_golden_row_parallel_scale_bias() -> None:
    t = ROW.quantize(GOLDEN_W)  # in = 16: each of the 16 chunks is one column, 8·q·s
    assert t["weight"].numpy().tobytes() == GOLDEN_WEIGHT
    s = [1.0, 2.0, 2.0**-23, 1 / 16]
    assert t["scale_bias"].tolist() == [[8 * q * s[r] for q in GOLDEN_Q[r]] for r in range(4)]


# --- msModelSlim 26.1.0, re-implemented from its source (not with hetquant's helpers) ---------


def ref_w4a8_pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``save/utils/pack.py:25-68``: transpose to [k, n], pairs (w0, w1) along n →
    ``(w1 << 4) | (w0 & 0b1111)`` in int8, transpose back to [n/2, k]."""
    w = q.to(torch.int8).transpose(-1, -2).contiguous()  # (k, n)
    k, n = w.shape
    pairs = w.reshape(-1, 2)
    packed = torch.bitwise_or(torch.bitwise_left_shift(pairs[:, 1:], 4), pairs[:, :1] & 0b1111)
    return packed.reshape(k, n // 2).transpose(-1, -2).contiguous()


def ref_process_scale(deq: torch.Tensor, tp_num: int) -> torch.Tensor:
    """``pack.py:71-90`` on ``q·s`` [n, k]: gate/up ``8·sum(dim=1)``; down chunks of k/tp_num."""
    if tp_num == 1:
        return 8 * deq.sum(dim=1, keepdim=True)
    n, k = deq.shape
    return (8 * deq.reshape(-1, k // tp_num).sum(dim=1, keepdim=True)).reshape(n, -1)


def ref_int4_minmax(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ir/api/impl/int_quantization.py:41-89, 130-155``, symmetric int4 per channel, in F32."""
    eps = torch.tensor([torch.finfo(torch.float32).eps])
    lo = torch.min(w.amin(dim=1, keepdim=True), torch.zeros(1))
    hi = torch.max(w.amax(dim=1, keepdim=True), torch.zeros(1))
    scale = torch.max(torch.max(-lo, hi) / 7.0, eps)
    return (w / scale + 0).round_().clamp_(-8, 7), scale


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9).map(lambda r: 2 * r),
    chunks=st.sampled_from(w4.BIAS_CHUNKS),
    per=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_msmodelslim_port_agrees(rows: int, chunks: int, per: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, chunks * per * 2, generator=g) * torch.logspace(-3, 1, rows)[:, None]
    fmt = get_format("w4a8_dynamic", bias_chunks=chunks)
    t = fmt.quantize(w)
    q, s = ref_int4_minmax(w)
    assert torch.equal(t["weight_scale"], s)
    assert torch.equal(t["weight"], ref_w4a8_pack_int4(q))
    ref = ref_process_scale(q * s, chunks)  # F32 sums: rounding errors of at most γ_m Σ|terms|
    m = w.shape[1] // chunks
    slack = ref_process_scale((q * s).abs(), chunks) * (m + 1) * 2.0**-24
    assert bool(((t["scale_bias"] - ref).abs() <= slack).all())


def test_every_code_pair_round_trips() -> None:
    codes = torch.arange(-8, 8)
    q = torch.stack(torch.meshgrid(codes, codes, indexing="ij")).reshape(2, -1)  # all 256 pairs
    packed = w4.pack_out_pairs(q.to(torch.int8))
    assert sorted(packed.view(torch.uint8).reshape(-1).tolist()) == list(range(256))
    assert torch.equal(w4.unpack_out_pairs(packed), q.to(torch.int8))


@settings(max_examples=60, deadline=None)
@given(
    w=float_weights(
        st.tuples(st.integers(1, 6).map(lambda r: 2 * r), st.integers(1, 4).map(lambda c: 16 * c))
    ),
    zero_row=st.booleans(),
    bf16=st.booleans(),
)
def test_error_bound(w: np.ndarray, zero_row: bool, bf16: bool) -> None:
    """|W - dequantize(quantize(W))| <= s/2 per row, up to F32 rounding of W/s and q·s."""
    weight = as_weight(w, zero_row, bf16)
    for fmt in (COL, ROW):
        t = fmt.quantize(weight)
        s = t["weight_scale"].double()
        err = (weight.double() - fmt.dequantize(t).double()).abs()
        assert (s >= w4.SCALE_FLOOR).all()
        assert (err <= s * (0.5 + 2.0**-20)).all()
        w4.check_scale_bias(t, fmt.bias_chunks)  # the derived tensor is the exact formula's


def test_scale_bias_exact_formula() -> None:
    q = torch.full((2, 2048), 7, dtype=torch.int8)
    s = torch.tensor([[1 / 3], [3.0e-3]], dtype=torch.float32)
    got = w4.scale_bias(q, s, 16)  # 8 · 7 · 128 · s per chunk, rounded once from float64
    want = (8 * 7 * 128 * s.double()).float().expand(2, 16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", [COL, ROW], ids=["col", "row"])
@pytest.mark.parametrize("shape", [(2, 16), (6, 48), (2048, 7168), (7168, 2048)])
def test_stored_matches_quantize(fmt, shape: tuple[int, int]) -> None:
    if shape[0] * shape[1] > 1 << 20:  # real DeepSeek expert shapes: metadata only
        half = shape[0] // 2
        assert fmt.stored(shape)["weight"].shape == (half, shape[1])
        # 4-bit codes + F32 scale, offset and scale_bias columns per row
        assert fmt.bits_per_weight(shape) == 4 + 32 * (2 + fmt.bias_chunks) / shape[1]
        return
    t = fmt.quantize(torch.randn(shape))
    fmt.check_stored(t, shape)


def test_shard_recomputes_its_scale_bias() -> None:
    """A column shard of a down_proj keeps its rows' codes and scales; its scale_bias is its own,
    and sums to what vllm-ascend sums from the whole tensor's narrowed chunks (w4a8.py:628-631)."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    t = ROW.quantize(w)
    tp = 4
    for r in range(tp):
        cols = slice(r * 64, (r + 1) * 64)
        part = {
            "weight": t["weight"][:, cols],
            "weight_scale": t["weight_scale"],
            "weight_offset": t["weight_offset"],
            "scale_bias": t["scale_bias"],
        }
        shard = ROW.shard_fixup(part, (0, 8), (r * 64, (r + 1) * 64))
        ROW.check_stored(shard, (8, 64))
        w4.check_scale_bias(shard, 16)
        narrowed = t["scale_bias"][:, r * 4 : (r + 1) * 4].double().sum(dim=1)
        assert torch.allclose(shard["scale_bias"].double().sum(dim=1), narrowed, rtol=1e-6)
        want = ROW.dequantize(t)[:, cols]
        assert torch.equal(ROW.dequantize(shard), want)


@pytest.mark.parametrize(
    ("fmt", "shape", "needle"),
    [
        (COL, (3, 16), "out must be even"),
        (ROW, (4, 40), "in must be a multiple of 16"),
        (COL, (0, 16), "2-D weights"),
    ],
)
def test_shapes_that_do_not_pack(fmt, shape, needle: str) -> None:
    with pytest.raises(HetquantError, match=needle):
        fmt.stored(shape)
    if min(shape):
        with pytest.raises(HetquantError, match=f"x.weight: .*{needle}"):
            fmt.quantize(torch.ones(shape), name="x.weight")


def test_other_bad_inputs() -> None:
    with pytest.raises(HetquantError, match=r"bias_chunks 4 is not one of \[1, 16\]"):
        get_format("w4a8_dynamic", bias_chunks=4)
    bad = torch.ones(4, 16)
    bad[1, 3] = float("nan")
    with pytest.raises(HetquantError, match="NaN/Inf"):
        COL.quantize(bad)
    with pytest.raises(HetquantError, match="float 2-D"):
        COL.quantize(torch.ones(4, 16, dtype=torch.int32))
    t = COL.quantize(torch.randn(4, 16))
    with pytest.raises(HetquantError, match="scale_bias"):
        COL.dequantize({k: v for k, v in t.items() if k != "scale_bias"})
    with pytest.raises(HetquantError, match="scale_bias disagrees"):
        w4.check_scale_bias({**t, "scale_bias": t["scale_bias"] + 1}, 1)
    with pytest.raises(HetquantError, match="pairs"):
        w4.pack_out_pairs(torch.zeros(3, 4, dtype=torch.int8))


@pytest.mark.parametrize("fmt", [COL, ROW], ids=["col", "row"])
def test_fake_quant_is_per_row(fmt) -> None:
    """``dequantize(quantize(W))`` as calibration uses it: float in, float out, rows independent
    (a block of rows quantizes as those rows of the whole weight do)."""
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(5))
    whole = fmt.dequantize(fmt.quantize(w))
    assert whole.dtype == torch.float32 and whole.shape == w.shape
    for r0, r1 in ((0, 2), (4, 10), (10, 12)):
        assert torch.equal(fmt.dequantize(fmt.quantize(w[r0:r1])), whole[r0:r1])
