"""The native FP4 GEMV (``runtime/kernels/fp4_gemv.py``): every instruction path of this CPU equal,
bit for bit, to the torch reference ``fp4_gemv_int8`` on random shapes (odd row counts, every
superblock tail, T = 1 / 8 / 64, strided rows and scale rows, any thread count); the cases are
order-sensitive (another float64 summation order changes bits), so the equality pins the order;
a hand-computed golden case; the calls the kernel hands to the reference; bad input."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.formats.fp4_cpu import fp4_gemv_int8
from hetquant.formats.fp4_e2m1 import E2M1_X2, unpack_e2m1
from hetquant.runtime.kernels import fp4_gemv as F
from hetquant.runtime.kernels import int4_gemv as G

SHAPES = [  # (N, K, T, row pad bytes, scale row pad): K = 32 · (any number of groups)
    (1, 32, 1, 0, 0),
    (5, 96, 8, 0, 0),
    (7, 384, 1, 3, 1),
    (13, 544, 64, 0, 0),
    (3, 1056, 8, 16, 2),
    (33, 1152, 1, 0, 0),
    (64, 2080, 3, 0, 0),
    (9, 7168, 1, 0, 0),
    (11, 2048, 64, 5, 3),
    (131, 4096, 17, 0, 0),
]


@pytest.fixture(autouse=True)
def _native() -> None:
    if not G.native_available():
        pytest.skip(f"native kernel unavailable: {G.native_info()['error']}")


def data(n: int, k: int, t: int, rs_pad: int = 0, ss_pad: int = 0, seed: int = 0):
    """Codes (rows of K/2 bytes, stride K/2 + rs_pad), UE8M0 scales with a wide exponent spread
    (stride K/32 + ss_pad) and activations of mixed magnitudes (a zero token when t > 2); from
    K = 512 on, two groups whose terms cancel exactly and dwarf the others by > 2^53 (the order
    of the float64 additions then decides what survives)."""
    g = torch.Generator().manual_seed(seed or n * k + t)
    packed = torch.randint(0, 256, (n, k // 2 + rs_pad), dtype=torch.uint8, generator=g)
    e = torch.randint(60, 150, (n, k // 32 + ss_pad), dtype=torch.uint8, generator=g)
    x = torch.randn(t, k, generator=g) * torch.exp2(torch.randint(-20, 20, (t, 1), generator=g))
    if t > 2:
        x[1] = 0.0
    if k >= 512:  # groups 0 and 8 (both in partial p0) cancel: big terms, as float64 sees them
        packed[:, 128:144] = packed[:, 0:16] ^ 0x88  # every code's sign flipped
        e[:, 0] = e[:, 8] = 230
        x[:, 256:288] = x[:, 0:32]
    return packed[:, : k // 2], e.view(torch.float8_e8m0fnu)[:, : k // 32], x


def every_path(packed, scale, x, monkeypatch, **kw) -> torch.Tensor:
    """The native result of every instruction path of this CPU, asserted bit-identical."""
    outs = []
    for isa in G.isa_names():
        monkeypatch.setenv("HETQUANT_INT4_ISA", isa)
        outs.append(F.fp4_gemv(packed, scale, x, backend="native", **kw))
    monkeypatch.delenv("HETQUANT_INT4_ISA")
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int32), outs[0].view(torch.int32))
    return outs[0]


@pytest.mark.parametrize(("n", "k", "t", "rs_pad", "ss_pad"), SHAPES)
def test_every_path_is_the_reference_bit_for_bit(monkeypatch, n, k, t, rs_pad, ss_pad) -> None:
    packed, scale, x = data(n, k, t, rs_pad, ss_pad)
    ref = fp4_gemv_int8(packed, scale, x)
    for threads in (1, 3):
        y = every_path(packed, scale, x, monkeypatch, threads=threads)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), threads
    assert torch.equal(F.fp4_gemv(packed, scale, x, backend="torch"), ref)
    assert torch.equal(F.fp4_gemv(packed, scale, x[0]), ref[0])  # 1-D x


def _sequential(packed, scale, x) -> torch.Tensor:
    """The same exact group terms summed in another order (one chain, last group first)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    sx = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(x / torch.where(sx > 0, sx, torch.ones_like(sx))).double()
    w = torch.tensor(E2M1_X2, dtype=torch.float64)[unpack_e2m1(packed).long()]
    terms = torch.einsum("tgk,ngk->tng", q.view(-1, k // 32, 32), w.view(n, k // 32, 32))
    terms = terms * torch.exp2(scale.view(torch.uint8).double() - 128)[None]
    acc = torch.zeros(terms.shape[:2], dtype=torch.float64)
    for g in reversed(range(terms.shape[2])):
        acc = acc + terms[..., g]
    return (acc * sx.double()).float()


def test_the_cases_are_order_sensitive() -> None:
    """The shapes above are not exactly summable in float64: another order changes bits, so
    the bit-for-bit equality of every path does pin the order (not just exact arithmetic)."""
    differ = 0
    for n, k, t, rs_pad, ss_pad in SHAPES:
        packed, scale, x = data(n, k, t, rs_pad, ss_pad)
        ref = fp4_gemv_int8(packed, scale, x)
        other = _sequential(packed, scale, x)
        if k < 512:  # no cancelling groups: the same value up to float64 rounding
            assert float((other - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
        differ += int((other.view(torch.int32) != ref.view(torch.int32)).sum())
    assert differ > 0


def test_golden() -> None:
    """K = 64: code 7 (+6) at k = 0, code 15 (−6) at k = 33, code 1 (+0.5) at k = 63, scales 2^0
    and 2^2; x[k] = k − 32 but x[5] = 127 (amax 127: sx = 1, q = x). y = 6·(−32) + 4·(−6·1 +
    0.5·31) = −154."""
    row = [0] * 32
    row[0], row[16], row[31] = 0x07, 0xF0, 0x10  # element 2j: low nibble of byte j
    packed = torch.tensor([row], dtype=torch.uint8)
    scale = torch.tensor([[127, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.arange(64, dtype=torch.float32)[None] - 32
    x[0, 5] = 127.0
    for backend in ("native", "torch"):
        assert F.fp4_gemv(packed, scale, x, backend=backend).tolist() == [[-154.0]]


def test_extreme_scales_and_a_zero_token(monkeypatch) -> None:
    """Scale bytes 0 (2^-127) and 254 (2^127) in one row; a zero token gives +0."""
    packed, _, x = data(6, 256, 3)
    e = torch.tensor([0, 254, 1, 253, 127, 0, 254, 60] * 6, dtype=torch.uint8).view(6, 8)
    scale = e.view(torch.float8_e8m0fnu)
    ref = fp4_gemv_int8(packed, scale, x)
    y = every_path(packed, scale, x, monkeypatch, threads=2)
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    assert y[1].view(torch.int32).eq(0).all()  # +0.0, not -0.0


def test_nan_scale_is_refused() -> None:
    packed, scale, x = data(4, 96, 2)
    bad = scale.view(torch.uint8).clone()
    bad[3, 2] = 0xFF
    for backend in ("native", "torch"):
        with pytest.raises(HetquantError, match=r"1 NaN scale"):
            F.fp4_gemv(packed, bad.view(torch.float8_e8m0fnu), x, backend=backend)


def test_nonfinite_activations_take_the_reference() -> None:
    packed, scale, x = data(5, 128, 3)
    x[2, 7] = float("nan")
    y = F.fp4_gemv(packed, scale, x, backend="native")
    torch.testing.assert_close(y, fp4_gemv_int8(packed, scale, x), rtol=0, atol=0, equal_nan=True)
    assert y[2].isnan().all() and not y[0].isnan().any()


def test_subnormal_amax_takes_the_reference() -> None:
    """amax = 190 · 2^-149: amax / 127 rounds to 2^-149, so q = 190 (not int8): the reference's
    int32 arithmetic takes the call, with the same result as calling it."""
    packed, scale, _ = data(3, 64, 1)
    x = torch.zeros(1, 64)
    x[0, 0] = 190 * 2.0**-149
    x[0, 9] = -(2.0**-149)
    assert float(x.abs().max() / 127) == 2.0**-149
    y = F.fp4_gemv(packed, scale, x, backend="native")
    assert torch.equal(y, fp4_gemv_int8(packed, scale, x))


@pytest.mark.parametrize(
    ("codes", "scale", "x", "match"),
    [
        ((4, 16), (3, 1), (2, 32), r"float8_e8m0fnu \[4, K/32\]"),
        ((4, 16), (4, 2), (2, 32), r"scale .* for codes \[4, K=32\]"),
        ((4, 24), (4, 1), (2, 48), r"K a multiple of 32"),
        ((4, 16), (4, 1), (2, 31), r"expected float \[T, 32\]"),
    ],
)
def test_bad_shapes(codes, scale, x, match) -> None:
    packed = torch.zeros(codes, dtype=torch.uint8)
    s = torch.full(scale, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(HetquantError, match=match):
        F.fp4_gemv(packed, s, torch.zeros(x))


def test_bad_dtypes_and_backend() -> None:
    packed, scale, x = data(2, 64, 1)
    with pytest.raises(HetquantError, match=r"codes must be uint8"):
        F.fp4_gemv(packed.view(torch.int8), scale, x)
    with pytest.raises(HetquantError, match=r"float8_e8m0fnu"):
        F.fp4_gemv(packed, scale.view(torch.uint8), x)
    with pytest.raises(HetquantError, match=r"expected float"):
        F.fp4_gemv(packed, scale, x.to(torch.int32))
    with pytest.raises(HetquantError, match=r"backend 'gpu'"):
        F.fp4_gemv(packed, scale, x, backend="gpu")


def test_subpool_slices_give_one_pools_rows() -> None:
    """``subpool_slice`` (split="inter"): a subpool's gate_up rows (a slice of I) and its down
    rows (a slice of H, all of I: ``subpool_down = "rows"``) are one pool's rows bit for bit —
    rows are independent; threads and subpools only split them."""
    from hetquant.formats.fp4_cpu import Fp4CpuExperts

    g = torch.Generator().manual_seed(5)
    e, h, i = 2, 256, 128
    layer = {
        "gate_up_packed": torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g),
        "gate_up_scale": torch.randint(100, 140, (e, 2 * i, h // 32), dtype=torch.uint8,
                                       generator=g).view(torch.float8_e8m0fnu),
        "down_packed": torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g),
        "down_scale": torch.randint(100, 140, (e, h, i // 32), dtype=torch.uint8,
                                    generator=g).view(torch.float8_e8m0fnu),
    }  # fmt: skip
    x, act = torch.randn(3, h, generator=g), torch.randn(3, i, generator=g)
    gate_up = F.fp4_gemv(layer["gate_up_packed"][1], layer["gate_up_scale"][1], x, threads=2)
    down = F.fp4_gemv(layer["down_packed"][1], layer["down_scale"][1], act, threads=2)
    for s in range(4):
        part = Fp4CpuExperts().subpool_slice(layer, s, 4)
        y = F.fp4_gemv(part["gate_up_packed"][1], part["gate_up_scale"][1], x, threads=1)
        rows = slice(2 * s * i // 4, 2 * (s + 1) * i // 4)
        assert torch.equal(y.view(torch.int32), gate_up[:, rows].view(torch.int32))
        d = F.fp4_gemv(part["down_packed"][1], part["down_scale"][1], act, threads=1)
        rows = slice(s * h // 4, (s + 1) * h // 4)
        assert torch.equal(d.view(torch.int32), down[:, rows].view(torch.int32))
