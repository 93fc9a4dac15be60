"""The fused C++ row kernels (formats/_rows_native.py) against the torch code they replace.

Bit-identical outputs on every instruction path the CPU has, for inputs that reach each edge:
every E4M3 code (subnormal, zero, ±, the largest) against scales that make normal, subnormal
and near-overflow BF16 products and RNE ties; partial blocks (rows and columns), other block
edges; W8A8 and INT4 rows with zero rows, rows under the scale floor, exact ties, huge and tiny
magnitudes. Then what falls back to torch: NaN codes and values (the format's error is raised),
unsupported tensors, the kernels disabled. The FP8 absmax kernel (one pass over the codes, what
a per-tensor NVFP4 scale needs) against ``absmax_dequantized`` and the dequantized rows' max.
A CUDA test (skipped without a GPU) checks the
device dequantization of calibration against the CPU kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetquant.formats import HetquantError, int4_cpu, w8a8_npu, w8a8_npu_rows
from hetquant.formats import _quant_native as Q
from hetquant.formats import _rows_native as R
from hetquant.formats.arrays import NotNative
from hetquant.formats.base import all_finite
from hetquant.formats.fp8_block import Fp8Block, absmax_dequantized, dequantize_rows
from hetquant.formats.fp8_block_scale import Fp8BlockScale
from hetquant.formats.int4_cpu import Int4CpuExperts, quantize_expert
from hetquant.formats.int4_cpu_rows import quantize_rows_torch

DTYPES = (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if not Q.available():
        pytest.skip(f"kernels unavailable: {Q.QUANT_LIBRARY.get().error}")


def _isas() -> list[int]:
    return [i for i in Q.ISAS.values() if i <= Q.best_isa()]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    )


def _codes(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random E4M3 codes, no NaN (0x7F / 0xFF), every other code possible."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
    c[(c & 0x7F) == 0x7F] = 0x7E
    return c.view(torch.float8_e4m3fn)


def _scales(shape: tuple[int, int], lo: float, hi: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=g)).float()


# ---- FP8 block → BF16 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(-16, -10), (-140, -120), (-150, -133), (-1, 1), (100, 118.8)],
    ids=["deepseek", "subnormal-products", "deep-subnormal", "near-one", "near-bf16-max"],
)
@pytest.mark.parametrize(("rows", "cols", "block"), [(128, 7168, 128), (72, 1000, 128), (5, 300, 64), (1, 16, 16)])  # fmt: skip
def test_fp8_rows_match_torch(lo: float, hi: float, rows: int, cols: int, block: int) -> None:
    codes = _codes(rows, cols, seed=rows + cols)
    s = _scales((1, -(-cols // block)), lo, hi, seed=block)
    want = dequantize_rows(codes, s, 0, block)
    for isa in _isas():
        got = R.fp8_dequant_rows(codes, s[0], block, isa)
        assert got is not None and _same(got, want), isa


def test_fp8_every_code_with_tie_scales() -> None:
    """All 254 non-NaN codes against scales whose products sit on BF16 rounding ties."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)[None].repeat(3, 1)  # (3, 254)
    ties = ([1.0 + 2**-8, 1.0 + 3 * 2**-9], [2**-133 * 1.5, 0.0], [1e-30, 3.0], [-1.5, -0.0])
    for scales in ties:  # a negative scale (refused by the format) takes the scalar table path
        sc = torch.tensor([scales], dtype=torch.float32)
        want = dequantize_rows(codes, sc, 0, 128)
        for isa in _isas():
            assert _same(R.fp8_dequant_rows(codes.contiguous(), sc[0], 128, isa), want)


def test_fp8_nan_codes_fall_back_and_raise() -> None:
    fmt = Fp8Block()
    w = _codes(256, 256, seed=3)
    s = _scales((2, 2), -12, -10, seed=4)
    for nan in (0x7F, 0xFF):
        bad = w.view(torch.uint8).clone()
        bad[200, 17] = nan
        bad = bad.view(torch.float8_e4m3fn)
        assert R.fp8_dequant_rows(bad[128:], s[1], 128) is None
        assert R.fp8_dequant_rows(bad[:128], s[0], 128) is not None  # the other block row
        with pytest.raises(HetquantError, match=r"m\.weight: NaN code"):
            list(fmt.source_rows("m", {"weight": bad, "weight_scale_inv": s}, (256, 256)))


def test_fp8_unsupported_inputs_give_none() -> None:
    codes = _codes(8, 256, seed=5)
    s = _scales((1, 2), -12, -10, seed=6)[0]
    for bad in (float("inf"), float("nan")):  # scales the format refuses: torch decides
        assert R.fp8_dequant_rows(codes, torch.tensor([1.0, bad]), 128) is None
    assert R.fp8_dequant_rows(codes.t(), s, 128) is None  # not contiguous
    assert R.fp8_dequant_rows(codes, s.double(), 128) is None  # scale dtype
    assert R.fp8_dequant_rows(codes, s[:1], 128) is None  # scale count
    assert R.fp8_dequant_rows(codes.view(torch.int8), s, 128) is None  # dtype


def test_source_rows_and_whole_weight_equal_the_torch_formula() -> None:
    """The format's streamed rows (kernel) and whole weight (kernel, and torch in chunks as on a
    device) are DeepSeek's formula on a weight with partial blocks both ways."""
    fmt = Fp8Block()
    w = _codes(300, 200, seed=7)
    s = _scales((3, 2), -16, -10, seed=8)
    want = fmt.dequantize_bf16(w, s)
    got = torch.cat([r for _, r in fmt.source_rows("m", {"weight": w, "weight_scale_inv": s}, (300, 200))])  # fmt: skip
    assert _same(got, want)
    assert _same(fmt.source_dequantized("m", {"weight": w, "weight_scale_inv": s}, (300, 200)), want)  # fmt: skip
    assert _same(fmt.dequantized_in_chunks("m", w, s), want)


def test_whole_weight_in_small_chunks(monkeypatch) -> None:
    """Chunks of one block row (DEVICE_CHUNK small) pick their own scale rows."""
    import hetquant.formats.fp8_block as F

    monkeypatch.setattr(F, "DEVICE_CHUNK", 1)
    fmt = Fp8Block()
    w, s = _codes(300, 200, seed=9), _scales((3, 2), -16, -10, seed=10)
    assert _same(fmt.dequantized_in_chunks("m", w, s), fmt.dequantize_bf16(w, s))
    bad = w.view(torch.uint8).clone()
    bad[299, 0] = 0xFF
    with pytest.raises(HetquantError, match="NaN code"):
        fmt.dequantized_in_chunks("m", bad.view(torch.float8_e4m3fn), s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_dequantization_equals_the_cpu_kernel() -> None:
    fmt = Fp8Block()
    w, s = _codes(2048, 7168, seed=11), _scales((16, 56), -150, -10, seed=12)
    want = fmt.source_dequantized("m", {"weight": w, "weight_scale_inv": s}, (2048, 7168))
    dev = {"weight": w.cuda(), "weight_scale_inv": s.cuda()}
    got = fmt.source_dequantized("m", dev, (2048, 7168))
    assert got.device.type == "cuda" and _same(got.cpu(), want)


# ---- FP8 block absmax ----------------------------------------------------------------------------


def _np(t: torch.Tensor):
    return Q.host_array(t.contiguous())


@pytest.mark.parametrize(("lo", "hi"), [(-16, -10), (-150, -133), (-1, 1), (100, 118.8)])
@pytest.mark.parametrize(("rows", "cols", "block"), [(256, 7168, 128), (300, 1000, 128), (5, 300, 64), (1, 16, 16), (0, 16, 128)])  # fmt: skip
def test_fp8_absmax_matches_the_torch_reduction(lo: float, hi: float, rows: int, cols: int, block: int) -> None:  # fmt: skip
    """== absmax_dequantized and == the max of the dequantized rows, partial blocks included."""
    codes = _codes(rows, cols, seed=rows + cols + block)
    s = _scales((max(1, -(-rows // block)), -(-cols // block)), lo, hi, seed=rows)
    want = absmax_dequantized(codes, s, block)
    assert R.fp8_absmax_array(_np(codes), s.numpy(), block) == want
    tensors = {"weight": codes, "weight_scale_inv": s}
    deq = Fp8Block(block=block).source_rows("m", tensors, (rows, cols))
    assert want == max((float(r.float().abs().amax()) for _, r in deq), default=0.0)


def test_fp8_absmax_every_code_and_tie_scales() -> None:
    """One column per code (subnormals, zero, ±), in every block row a scale whose products sit
    on BF16 ties; the largest code alone in a column, then each code the column's largest."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # (254,)
    for scale in (1.0 + 2**-8, 1.0 + 3 * 2**-9, 2**-133 * 1.5, 1e-30, 3.0):
        s = torch.full((2, 2), scale)
        for top in (codes, codes[codes < 0x08]):  # all, then only subnormal / zero codes
            w = top[None].repeat(130, 1).view(torch.float8_e4m3fn)
            want = absmax_dequantized(w, s, 128)
            assert R.fp8_absmax_array(_np(w), s.numpy(), 128) == want, scale


@pytest.mark.parametrize("seed", range(6))
def test_fp8_absmax_reads_only_blocks_that_can_hold_it_and_stays_exact(seed: int) -> None:
    """The walk from the largest block bound down is the full reduction, whatever the codes:
    blocks whose codes are small under large scales (the walk must go on past them), scales
    repeated (equal bounds), a block holding only zeros; and it stops early: a NaN code in a
    block whose bound is below the maximum is never read (the dequantizing pass refuses it)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols, block = 3 * 128 + 17, 5 * 128 + 9, 128
    codes = _codes(rows, cols, seed=seed).view(torch.uint8).clone()
    top = torch.randint(1, 0x7F, (4, 6), generator=g, dtype=torch.int32)  # each block's largest
    for i in range(4):
        for j in range(6):
            blk = codes[i * block : (i + 1) * block, j * block : (j + 1) * block]
            blk.copy_(blk % (int(top[i, j]) + 1) | (blk & 0x80))  # magnitudes <= top[i, j]
    codes[:block, :block] = 0
    s = _scales((4, 6), -14, -6, seed=seed + 50)
    s[1, :3] = s[2, 2]  # equal bounds
    want = absmax_dequantized(codes.view(torch.float8_e4m3fn), s, block)
    assert R.fp8_absmax_array(codes.numpy(), s.numpy(), block) == want
    bounds = (torch.tensor(448.0) * s).to(torch.bfloat16).float()
    i, j = divmod(int(bounds.argmin()), 6)
    if float(bounds[i, j]) < want:  # that block cannot hold the maximum: it is not read
        codes[i * block, j * block] = 0xFF
        assert R.fp8_absmax_array(codes.numpy(), s.numpy(), block) == want


def test_fp8_absmax_refuses_nan_codes_and_bad_scales() -> None:
    """A NaN code in a block that may hold the maximum: None from the kernel, NotNative from the
    format (the torch code then raises); a bad scale: the format's own error first."""
    fmt, shape = Fp8Block(), (256, 256)
    w = _codes(*shape, seed=7).view(torch.uint8).clone()
    s = _scales((2, 2), -12, -10, seed=8)
    i, j = divmod(int(s.argmax()), 2)  # the largest bound: always read
    w[i * 128 + 127, j * 128] = 0xFF
    assert R.fp8_absmax_array(w.numpy(), s.numpy(), 128) is None
    with pytest.raises(NotNative):
        fmt.source_absmax_array("m", {"weight": w.numpy(), "weight_scale_inv": s.numpy()}, shape)
    with pytest.raises(HetquantError, match="NaN code"):
        fmt.source_absmax("m", {"weight": w.view(torch.float8_e4m3fn), "weight_scale_inv": s}, shape)  # fmt: skip
    s[1, 1] = float("nan")
    with pytest.raises(HetquantError, match=r"m\.weight_scale_inv: 1 NaN/Inf"):
        fmt.source_absmax_array("m", {"weight": w.numpy(), "weight_scale_inv": s.numpy()}, shape)
    assert R.fp8_absmax_array(w.numpy().T, s.numpy(), 128) is None  # not C-contiguous
    assert R.fp8_absmax_array(w.numpy(), s.numpy()[:1], 128) is None  # too few block rows


@pytest.mark.parametrize("fmt", [Fp8Block(), Fp8BlockScale(scale_dtype="F8_E8M0")])
def test_source_absmax_array_is_the_torch_source_absmax(fmt) -> None:
    """The formats' numpy ``source_absmax_array`` == their torch ``source_absmax`` (DeepSeek-V4's
    UE8M0 scales too); a BF16 source's default goes through its validated rows."""
    shape = (300, 520)
    codes = _codes(*shape, seed=9)
    s = _scales((3, 5), -12, -6, seed=10)
    if isinstance(fmt, Fp8BlockScale):
        s = torch.exp2(torch.randint(-12, -6, (3, 5))).to(torch.float8_e8m0fnu)
        tensors = {"weight": codes, "scale": s}
    else:
        tensors = {"weight": codes, "weight_scale_inv": s}
    arrays = {k: _np(v) for k, v in tensors.items()}
    assert fmt.source_absmax_array("m", arrays, shape) == fmt.source_absmax("m", tensors, shape)
    from hetquant.formats.bf16 import Bf16

    w = (torch.randn(*shape) * 3).to(torch.bfloat16)
    got = Bf16().source_absmax_array("m", {"weight": _np(w)}, shape)
    assert got == Bf16().source_absmax("m", {"weight": w}, shape) == float(w.abs().amax())


# ---- W8A8 and INT4 rows --------------------------------------------------------------------------


def _rows(n: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, a zero row, a row under the scale floor, exact ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.empty(n, 1).uniform_(-30, 30, generator=g))  # fmt: skip
    w[0] = 0
    w[1] = torch.randn(k, generator=g) * 1e-36  # amax / 127 below FLT_EPSILON
    w[2] = torch.arange(k) % 15 - 7.0  # |w| <= 7: INT4 scale 1, every code exact
    w[3] = (torch.arange(k) % 255 - 127.0) / 2  # W8A8 scale 0.5: ties at half steps
    w[4, : k // 2] = -1e-40  # float32 subnormals
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 7168), (7, 2048), (1, 2), (33, 130)])
def test_w8a8_rows_match_torch(monkeypatch, dtype: torch.dtype, n: int, k: int) -> None:
    w = _rows(max(n, 5), k, seed=n * k, dtype=dtype)[:n].contiguous()
    got = w8a8_npu_rows.weight_tensors(w, "x")
    monkeypatch.setattr(w8a8_npu_rows, "w8a8_rows", lambda w: None)
    want = w8a8_npu_rows.weight_tensors(w, "x")
    for key in want:
        assert _same(got[key], want[key]), key
    for isa in _isas():
        q, scale = R.w8a8_rows(w, isa)
        assert _same(q, want["weight"]) and _same(scale, want["weight_scale"]), isa


def test_w8a8_codes_go_into_a_lent_array_and_only_a_fitting_one() -> None:
    """``w8a8_rows_array(q=)``: the codes computed into ``q`` (a view of a larger buffer, as the
    conversion lends the output's pages), the same bytes as a fresh array; a ``q`` of another
    shape, dtype or layout is not written, and a fresh array comes back."""
    w = _rows(16, 256, seed=5, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    want_q, want_s = R.w8a8_rows_array(w)
    buf = np.full(20 * 256, 7, np.int8)
    lent = buf[2 * 256 : 18 * 256].reshape(16, 256)  # C-contiguous rows inside the buffer
    q, s = R.w8a8_rows_array(w, q=lent)
    assert q is lent and np.array_equal(q, want_q) and np.array_equal(s, want_s)
    assert (buf[: 2 * 256] == 7).all() and (buf[18 * 256 :] == 7).all()  # nothing outside
    fmt = w8a8_npu.W8A8Dynamic()
    assert fmt.quantize_array(w, into={"weight": lent})["weight"] is lent
    frozen = np.zeros((16, 256), np.int8)
    frozen.flags.writeable = False
    for bad in (np.zeros((16, 255), np.int8), np.zeros((16, 256), np.uint8), np.zeros((256, 16), np.int8).T, frozen):  # fmt: skip
        q, _ = R.w8a8_rows_array(w, q=bad)
        assert q is not bad and np.array_equal(q, want_q) and not bad.any()


def test_int4_packed_rows_go_into_a_lent_array_and_only_a_fitting_one() -> None:
    """``int4_rows_array(packed=)`` / ``quantize_rows_array(into=)``: gate and up rows
    interleaved into ``packed`` (inside a larger buffer), the same bytes as a fresh array;
    one that does not fit is not written."""
    g = _rows(16, 256, seed=6, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    u = _rows(16, 256, seed=7, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    want_p, want_s = R.int4_rows_array(g, u)
    buf = np.full(36 * 128, 7, np.uint8)
    lent = buf[2 * 128 : 34 * 128].reshape(32, 128)  # [2 · 16, 256 / 2]
    packed, scale = Int4CpuExperts().quantize_rows_array(g, u, into=lent)
    assert packed is lent and np.array_equal(packed, want_p) and np.array_equal(scale, want_s)
    assert (buf[: 2 * 128] == 7).all() and (buf[34 * 128 :] == 7).all()
    frozen = np.zeros((32, 128), np.uint8)
    frozen.flags.writeable = False
    for bad in (np.zeros((16, 128), np.uint8), np.zeros((32, 128), np.int8), np.zeros((128, 32), np.uint8).T, frozen):  # fmt: skip
        packed, _ = R.int4_rows_array(g, u, packed=bad)
        assert packed is not bad and np.array_equal(packed, want_p) and not bad.any()
    want_down = R.int4_rows_array(g)  # one linear's rows (down): [16, 128]
    lent = buf[: 16 * 128].reshape(16, 128)
    packed, scale = Int4CpuExperts().quantize_rows_array(g, into=lent)
    assert packed is lent and np.array_equal(packed, want_down[0]) and np.array_equal(scale, want_down[1])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 7168), (7, 2048), (1, 2), (33, 130)])
def test_int4_rows_match_torch(dtype: torch.dtype, n: int, k: int) -> None:
    w = _rows(max(n, 5), k, seed=n + k, dtype=dtype)[:n].contiguous()
    want = quantize_rows_torch(w.float(), False)
    for isa in _isas():
        got = R.int4_rows(w, None, isa)
        assert got is not None and _same(got[0], want[0]) and _same(got[1], want[1]), isa
    assert all(map(_same, Int4CpuExperts().quantize_rows(w), want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_expert_interleaves_gate_and_up(dtype: torch.dtype) -> None:
    gate, up = _rows(64, 256, 1, dtype), _rows(64, 256, 2, dtype)
    down = _rows(256, 64, 3, dtype)
    got = quantize_expert(gate, up, down)
    gu = quantize_rows_torch(int4_cpu.interleave_rows(gate.float(), up.float()), False)
    d = quantize_rows_torch(down.float(), False)
    want = {"gate_up_packed": gu[0], "gate_up_scale": gu[1], "down_packed": d[0], "down_scale": d[1]}  # fmt: skip
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_rows_fall_back_and_raise(bad: float) -> None:
    w = _rows(8, 64, 4, torch.float32)
    w[6, 3] = bad
    assert R.w8a8_rows(w) is None and R.int4_rows(w) is None
    with pytest.raises(HetquantError, match="NaN/Inf"):
        w8a8_npu.W8A8Dynamic().quantize(w)
    with pytest.raises(HetquantError, match="NaN/Inf"):
        Int4CpuExperts().quantize_rows(w)
    with pytest.raises(HetquantError, match="NaN/Inf"):
        quantize_expert(w, w, w.t().contiguous())


def test_rows_unsupported_inputs_give_none() -> None:
    w = _rows(8, 64, 5, torch.float32)
    assert R.w8a8_rows(w.t()) is None and R.int4_rows(w.t()) is None  # not contiguous
    assert R.w8a8_rows(w.half()) is None and R.int4_rows(w.half()) is None
    assert R.int4_rows(w[:, :63].contiguous()) is None  # odd K
    assert R.int4_rows(w, w.to(torch.bfloat16)) is None  # mixed dtypes


def test_all_finite_matches_torch() -> None:
    w = _rows(8, 64, 6, torch.bfloat16)
    assert all_finite(w) and all_finite(torch.empty(0))
    for bad in (float("nan"), float("inf")):
        x = w.clone()
        x[7, 63] = bad
        assert not all_finite(x) and not all_finite(x.float()) and not all_finite(x[:, 1::2])


def test_kernels_disabled_give_the_same_bytes(monkeypatch) -> None:
    fmt = Fp8Block()
    w, s = _codes(130, 300, seed=13), _scales((2, 3), -16, -10, seed=14)
    rows = _rows(8, 64, 7, torch.bfloat16)
    native = (fmt.source_dequantized("m", {"weight": w, "weight_scale_inv": s}, (130, 300)),
              *Int4CpuExperts().quantize_rows(rows), *R.w8a8_rows(rows))  # fmt: skip
    monkeypatch.setenv("HETQUANT_QUANT_BACKEND", "torch")
    Q.QUANT_LIBRARY.reset()
    try:
        assert R.fp8_dequant_rows(w[:128].contiguous(), s[0], 128) is None
        assert R.w8a8_rows(rows) is None and R.int4_rows(rows) is None
        w8 = w8a8_npu_rows.weight_tensors(rows, "x")
        fallback = (fmt.source_dequantized("m", {"weight": w, "weight_scale_inv": s}, (130, 300)),
                    *Int4CpuExperts().quantize_rows(rows), w8["weight"], w8["weight_scale"])  # fmt: skip
    finally:
        monkeypatch.delenv("HETQUANT_QUANT_BACKEND")
        Q.QUANT_LIBRARY.reset()
    assert all(map(_same, native, fallback))
