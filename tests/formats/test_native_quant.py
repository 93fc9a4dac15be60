"""The fused C++ quantize kernels (formats/_quant_native.py) against the torch reference.

Every output tensor must be bit-identical (``torch.equal`` on the raw bytes) on every instruction
path, for inputs chosen to hit each rounding decision: E2M1 bounds and ties, E4M3 subnormal and
saturated block scales, FP16 subnormal AWQ scales, AWQ ties, one-sign and constant groups. Then
the fallbacks: ``HETQUANT_QUANT_BACKEND=torch``, a failed build, unsupported inputs, NaN/Inf.
Every NVFP4 input also goes through the native lane's numpy paths (``quantize_array`` of both
chunk layouts, and ``quantize_array_into`` the Ascend tile order chunk by chunk: ``check_nvfp4``).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.formats import _quant_native as Q
from hetquant.formats.arrays import NotNative
from hetquant.formats.awq_w4a16 import AwqW4A16
from hetquant.formats.native import NativeLibrary
from hetquant.formats.nvfp4 import BLOCK, E2M1_BOUNDS, E2M1_MAX, FP8_E4M3_MAX, Nvfp4
from hetquant.formats.nvfp4_ascend import K_ALIGN, N_ALIGN, _KMajorChunks, to_tiled
from hetquant.formats.nvfp4_codes import magnitude_codes

NVFP4_FORMATS = (Nvfp4(), _KMajorChunks())
DTYPES = (torch.bfloat16, torch.float32)
S2_ONE = E2M1_MAX * FP8_E4M3_MAX  # weight_amax that makes weight_scale_2 exactly 1


@pytest.fixture(scope="module")
def native() -> None:
    if not Q.available():
        pytest.skip(f"quantize kernels unavailable: {Q.QUANT_LIBRARY.get().error}")


@pytest.fixture
def fresh_kernels():
    """Forget the process's build before and after a test that changes how it is made."""
    Q.QUANT_LIBRARY.reset()
    yield
    Q.QUANT_LIBRARY.reset()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert torch.equal(_raw(g), _raw(w)), key


def check_nvfp4(w: torch.Tensor, weight_amax: float | None = None) -> None:
    """Format path (best ISA, amax and s2 included) and each ISA's kernel == torch, both layouts."""
    opts = {} if weight_amax is None else {"weight_amax": weight_amax}
    for fmt in NVFP4_FORMATS:
        if fmt._K_MAJOR and w.shape[0] % 2:
            continue
        want = fmt._quantize_torch(w, weight_amax)
        assert_same(fmt.quantize(w, **opts), want)
        s2 = float(want["weight_scale_2"])
        want.pop("weight_scale_2")
        for isa in Q.ISAS.values():
            got = Q.nvfp4(w.contiguous(), s2, fmt._K_MAJOR, isa=isa)
            assert got is not None
            assert_same({"weight": got[0], "weight_scale": got[1]}, want)
        if w.dtype in DTYPES and _finite_amax(weight_amax):
            arrays = fmt.quantize_array(Q.host_array(w.contiguous()), **opts)
            assert_same({k: torch.from_numpy(v) for k, v in arrays.items()}, _bytes(want, s2))
    if w.dtype in DTYPES and _finite_amax(weight_amax):
        check_tiled_into(w, weight_amax)


def _finite_amax(weight_amax: float | None) -> bool:
    """Whether the numpy path takes this ``weight_amax`` (else NotNative: the torch code)."""
    return weight_amax is None or abs(weight_amax) < float("inf")


def _bytes(stored: dict[str, torch.Tensor], s2: float) -> dict[str, torch.Tensor]:
    """Stored tensors as the numpy paths give them: E4M3 as its bytes, weight_scale_2 0-d."""
    out = {
        k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in stored.items()
    }
    return {**out, "weight_scale_2": torch.tensor(s2, dtype=torch.float32)}


def check_tiled_into(w: torch.Tensor, weight_amax: float | None) -> None:
    """``w`` placed at the top left of a zero weight of tileable shape (rows are independent
    once s2 is fixed), quantized chunk by chunk straight into the tile order, on every ISA and
    at chunk sizes whose 8-row words do and do not fall on a tile's 4-byte units, == the torch
    reference tiled (``to_tiled``)."""
    n = max(N_ALIGN, -(-w.shape[0] // N_ALIGN) * N_ALIGN)
    k = max(K_ALIGN, -(-w.shape[1] // K_ALIGN) * K_ALIGN)
    big = torch.zeros(n, k, dtype=w.dtype)
    big[: w.shape[0], : w.shape[1]] = w
    amax = float(w.float().abs().amax()) if weight_amax is None else weight_amax
    want = to_tiled(Nvfp4()._quantize_torch(big, amax))
    s2 = float(want["weight_scale_2"])
    rows = Q.host_array(big)
    for chunk, isa in ((128, 0), (n, 1), (6, 2), (2, 3), (40, 0)):
        out = {"weight": torch.zeros(k, n // 2, dtype=torch.uint8).numpy(),
               "weight_scale": torch.zeros(k // BLOCK, n, dtype=torch.uint8).numpy()}  # fmt: skip
        for r in range(0, n, chunk):
            if isa == 0:  # the format's method (best ISA)
                got = _KMajorChunks().quantize_array_into(rows[r : r + chunk], r, out, weight_amax=amax)  # fmt: skip
                assert got["weight_scale_2"].tobytes() == want["weight_scale_2"].numpy().tobytes()
            else:
                parts = (out["weight"], out["weight_scale"])
                assert Q.nvfp4_array(rows[r : r + chunk], s2, "tiled", parts, r, isa) is not None
        got_t = {k: torch.from_numpy(v) for k, v in out.items()}
        assert_same(got_t, {k: v.view(torch.uint8) for k, v in want.items() if k in out})


def check_awq(w: torch.Tensor, group: int) -> None:
    fmt = AwqW4A16(group_size=group)
    want = fmt._quantize_torch(w)
    assert_same(fmt.quantize(w), want)
    rows = Q.host_array(w.contiguous())
    assert rows is not None
    for isa in Q.ISAS.values():
        got = Q.awq_rtn(w.contiguous(), group, isa=isa)
        assert got is not None
        assert_same(got, want)
        # chunk by chunk into the whole weight's tensors (the native lane's quantize_array_into),
        # over bytes that are not zero: every byte must be written
        out = {k: np.full(v.shape, -1, v.numpy().dtype) for k, v in want.items()}
        for r0 in range(0, w.shape[0], 16):
            assert Q.awq_rtn_array(rows[r0 : r0 + 16], group, isa, out, r0) is out
        assert_same({k: torch.from_numpy(v) for k, v in out.items()}, want)


def _normal(n: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(dtype)


# ---- element conversions -------------------------------------------------------------------------


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return (
        bits.to(torch.int64)
        .sub(((bits.to(torch.int64) >> 31) & 1) << 32)
        .to(torch.int32)
        .view(torch.float32)
    )


def _e4m3_probe() -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours and the floats next to each, ±."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0..448
    mids = (vals[:-1].double() + vals[1:].double()) / 2  # exact in float32
    pts = torch.cat([vals, mids.float(), torch.tensor([448.0, 464.0, 480.0, 1e30, float("inf")])])
    inf = torch.full_like(pts, float("inf"))
    pts = torch.cat([pts, torch.nextafter(pts, inf), torch.nextafter(pts, -inf)])
    return torch.cat([pts, -pts, torch.tensor([float("nan")])])


def test_e4m3_encode_matches_torch(native: None) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            _e4m3_probe(),
            torch.randn(1 << 20, generator=g) * torch.exp2(torch.randint(-24, 12, (1 << 20,))),
            _f32(torch.arange(0, 1 << 32, 251, dtype=torch.int64)),  # a sweep of all bit patterns
        ]
    )
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = Q.e4m3_encode(x)
    saturates = torch.tensor([500.0]).to(torch.float8_e4m3fn).view(torch.uint8).item() == 0x7E
    keep = torch.ones_like(x, dtype=torch.bool) if saturates else ~(x.abs() >= 464)  # torch < 2.13
    assert torch.equal(got[keep], want[keep])


def test_e2m1_magnitude_is_the_bound_count(native: None) -> None:
    """The NVFP4 kernel codes y = |w| / step by rounding its bits (no comparisons): the same
    index as ``magnitude_codes``' bound count on every bound's neighbourhood (ties included), a
    sweep of all bit patterns (negative y, NaN and Inf among them) and random quotients."""
    bounds = torch.tensor(E2M1_BOUNDS, dtype=torch.float32)
    near = [bounds]
    up, down = bounds.clone(), bounds.clone()
    for _ in range(64):  # 64 floats either side of each bound
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, -float("inf")))
        near += [up, down]
    g = torch.Generator().manual_seed(3)
    y = torch.cat(
        [
            *near,
            _f32(torch.arange(0, 1 << 32, 127, dtype=torch.int64)),  # every sign and exponent
            torch.rand(1 << 20, generator=g) * 8,
            torch.tensor([0.0, -0.0, 6.0, 7.0, 1e38, float("inf"), -float("inf"), float("nan")]),
        ]
    )
    want = magnitude_codes(y, torch.zeros_like(y, dtype=torch.bool)).to(torch.uint8)
    assert torch.equal(Q.e2m1_magnitude(y), want)


def test_f16_encode_matches_torch(native: None) -> None:
    x = _f32(torch.arange(0, 1 << 32, 251, dtype=torch.int64))
    h = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    mids = ((h[:-1].double() + h[1:].double()) / 2).float()  # ties, exact in float32
    x = torch.cat([x, h, mids, torch.nextafter(mids, h[1:]), torch.nextafter(mids, h[:-1]), -mids])
    want, got = x.to(torch.float16), Q.f16_encode(x)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.isnan(got[nan]).all()


# ---- NVFP4 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(8, 16), (16, 32), (1, 16), (3, 48), (10, 96), (128, 256), (130, 528), (260, 272)]
)
def test_nvfp4_random(native: None, shape: tuple[int, int], dtype: torch.dtype) -> None:
    w = _normal(*shape, seed=shape[0] * 1000 + shape[1], dtype=dtype)
    check_nvfp4(w)
    check_nvfp4(w, weight_amax=float(w.float().abs().amax()) * 1.7)  # a block of a larger weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_zeros_outlier_negative_zero(native: None, dtype: torch.dtype) -> None:
    w = _normal(6, 64, seed=1, dtype=torch.float32)
    w[0] = 0.0  # an all-zero row
    w[1, :BLOCK] = 0.0  # an all-zero block
    w[2, 5] = 1e4  # one huge outlier: its block's other values round to 0 (and -0: code 8)
    w[3, :BLOCK] = -0.0  # -0.0 is not < 0: code 0
    w[3, BLOCK : 2 * BLOCK] = torch.tensor([-0.0, 1.0] * 8)
    w[4, :BLOCK] = -1e-30  # tiny negatives in a tiny block
    check_nvfp4(w.to(dtype))
    check_nvfp4(w.to(dtype), weight_amax=1.0)


def _bound_blocks(step: float) -> torch.Tensor:
    """Blocks whose y = |w| / step lands on, and one float either side of, every E2M1 bound and
    grid value, signed; the first element of a block sets amax = 6 * step (so sb = step with
    s2 = 1, when step is an E4M3 value)."""
    targets = torch.tensor(sorted(set(E2M1_BOUNDS) | {0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}))
    vals = targets * step
    inf = torch.full_like(vals, float("inf"))
    vals = torch.cat([vals, torch.nextafter(vals, inf), torch.nextafter(vals, -inf)])
    vals = torch.cat([vals, -vals])  # 84 values
    per = BLOCK - 1
    vals = torch.cat([vals, torch.zeros(-len(vals) % per)]).reshape(-1, per)  # (blocks, 15)
    head = torch.full((vals.shape[0], 1), 6.0 * step)
    return torch.cat([head, vals], dim=1).reshape(1, -1)  # (1, blocks * 16)


@pytest.mark.parametrize("step", [1.0, 2.0**-5, 1.125, 0.8125, 448.0 / 6, 2.0**-9])
def test_nvfp4_every_bound_and_tie(native: None, step: float) -> None:
    w = _bound_blocks(step)
    check_nvfp4(torch.cat([w, -w]), weight_amax=S2_ONE)  # s2 = 1: y is exactly |w| / step
    check_nvfp4(torch.cat([w, -w]))
    if step in (1.0, 2.0**-5):  # powers of two: every value is a bfloat16
        check_nvfp4(torch.cat([w, -w]).to(torch.bfloat16), weight_amax=S2_ONE)


def test_nvfp4_block_scales_over_the_e4m3_range(native: None) -> None:
    """Block amax from 1e-12 to 1e4 with s2 = 1/2688: block scales clamped at 2^-9, through the
    E4M3 subnormals (2^-9 .. 2^-6), normals, up to the clamp at 448 (y then beyond 6)."""
    n_blocks = 512
    amax = torch.logspace(-12, 4, n_blocks)  # (512,)
    g = torch.Generator().manual_seed(3)
    shape = torch.rand(n_blocks, BLOCK, generator=g) * 2 - 1
    shape[:, 0] = 1.0
    w = (shape * amax[:, None]).reshape(8, -1)  # (8, 1024)
    check_nvfp4(w, weight_amax=1.0)
    check_nvfp4(w * 1e-8, weight_amax=1.0)  # tiny weights: subnormal block scales


@pytest.mark.parametrize("weight_amax", [448.0, 5.0, 7.0, 11.0, 1e-3])
def test_nvfp4_block_scale_ties(native: None, weight_amax: float) -> None:
    """sb = amax / f32(6 * s2) on E4M3 midpoints. With weight_amax = 448, s2 = f32(1/6) and
    6 * s2 = 1 + 3e-8 rounds to 1.0 in float32: sb is then exactly a tie (1.1875 -> 1.25, even),
    where a float64 ``6 * s2`` would give 1.125. The torch code's E2M1_MAX * s2 is float32."""
    s2 = torch.tensor(weight_amax, dtype=torch.float32) / S2_ONE
    d = E2M1_MAX * s2  # float32 0-d, as in nvfp4_codes.block_scales_from_amax
    e4m3 = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = torch.cat([e4m3, (e4m3[:-1] + e4m3[1:]) / 2]).float()  # (251,)
    amax = mids * d  # (251,) float32
    w = torch.zeros(len(amax), BLOCK)
    w[:, 0], w[:, 1], w[:, 2] = amax, -amax / 3, amax / 7
    check_nvfp4(w.reshape(1, -1), weight_amax=weight_amax)


def test_nvfp4_saturation_after_scale_rounding(native: None) -> None:
    """sb = amax / 6 rounds down in E4M3 (1.06 -> 1.0), so y = amax / eff > 6 saturates; and a
    weight_amax below the block's amax clamps sb to 448."""
    w = torch.tensor([[6.36, 6.3, -6.36, 5.9] + [1.0] * 12] * 2)  # sb = 1.06 -> 1.0
    check_nvfp4(w, weight_amax=S2_ONE)
    check_nvfp4(_normal(4, 64, seed=5, dtype=torch.float32), weight_amax=1e-4)


@pytest.mark.parametrize("amax", [0.0, float("nan"), -1.0, 1e-42, 3e38, float("inf")])
def test_nvfp4_odd_weight_amax(native: None, amax: float) -> None:
    """s2 falls back to 1 (0, NaN, negative), is subnormal (eff underflows: y = inf or NaN ->
    code 7 or 0) or huge (eff = inf: y = 0)."""
    check_nvfp4(_normal(4, 32, seed=6, dtype=torch.float32), weight_amax=amax)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("weight_amax", [None, 1.0])
def test_nvfp4_nan_inf_raise(native: None, bad: float, weight_amax: float | None) -> None:
    w = _normal(4, 64, seed=7, dtype=torch.float32)
    w[3, 40] = bad
    opts = {} if weight_amax is None else {"weight_amax": weight_amax}
    for fmt in NVFP4_FORMATS:
        for dtype in DTYPES:
            with pytest.raises(HetquantError, match="NaN or Inf"):
                fmt.quantize(w.to(dtype), **opts)
    assert Q.nvfp4(w, 1.0, False) is None


def test_nvfp4_unsupported_inputs_use_torch(native: None) -> None:
    w = _normal(6, 64, seed=8, dtype=torch.float32)
    assert Q.nvfp4(w.t().contiguous().t(), 1.0, False) is None  # not contiguous
    assert Q.nvfp4(w.half(), 1.0, False) is None
    assert Q.nvfp4(w[:5], 1.0, True) is None  # K-major needs pairs of rows
    for fmt in NVFP4_FORMATS:
        for x in (w.half(), w.double(), w[:, :32].contiguous().t().contiguous().t()):
            assert_same(fmt.quantize(x), fmt._quantize_torch(x, None))


def test_nvfp4_arrays_decline_what_the_torch_code_must_do(native: None) -> None:
    """NaN/Inf rows, the calibrated variant and shapes or offsets a layout cannot take give
    NotNative / None (the lane then redoes the job with the torch code); arguments a layout
    cannot take are refused before anything is written."""
    w = _normal(256, 64, seed=9, dtype=torch.bfloat16)
    rows = Q.host_array(w)
    bad = w.clone()
    bad[200, 3] = float("nan")
    out = {"weight": torch.zeros(64, 128, dtype=torch.uint8).numpy(),
           "weight_scale": torch.zeros(4, 256, dtype=torch.uint8).numpy()}  # fmt: skip
    for fmt in NVFP4_FORMATS:
        with pytest.raises(NotNative):
            fmt.quantize_array(Q.host_array(bad))
        with pytest.raises(NotNative):
            fmt.quantize_array(rows, weight_amax=float("inf"))
        with pytest.raises(NotNative):
            type(fmt)(with_input_scale=True).quantize_array(rows, act_amax=1.0)
    with pytest.raises(NotNative):  # tiles before the NaN's may have been written
        _KMajorChunks().quantize_array_into(Q.host_array(bad), 0, dict(out), weight_amax=1.0)
    out = {k: v.copy() * 0 for k, v in out.items()}
    parts = (out["weight"], out["weight_scale"])
    assert Q.nvfp4_array(rows[:10], 1.0, "tiled", parts, 3) is None  # odd row0
    assert Q.nvfp4_array(rows[:10], 1.0, "tiled", parts, 250) is None  # past the weight's rows
    assert Q.nvfp4_array(rows[:9], 1.0, "kmajor") is None  # K-major: pairs of rows
    assert Q.nvfp4_array(rows[:, :48].copy(), 1.0, "tiled") is None  # K % 64
    assert Q.nvfp4_array(rows, 1.0, "tiled", (parts[0][:32], parts[1])) is None  # out's shape
    assert Q.nvfp4_array(rows, 1.0, "columns") is None
    assert Q.nvfp4_array(rows.astype("float16"), 1.0) is None
    assert Q.nvfp4_array(rows.T, 1.0) is None  # not C-contiguous
    for s2 in (0.0, -1.0, float("nan")):  # scale_2_from_amax never gives these: the torch code
        assert Q.nvfp4_array(rows, s2) is None
    assert not out["weight"].any() and not out["weight_scale"].any()


# ---- AWQ -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(8, 128, 128), (8, 64, 64), (24, 384, 128), (136, 576, 64), (264, 1280, 128), (16, 1088, 64)],
)
def test_awq_random(native: None, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    check_awq(_normal(n, k, seed=n * 1000 + k, dtype=dtype), group)


@pytest.mark.parametrize("group", [128, 64])
def test_awq_one_sign_constant_and_zero_groups(native: None, group: int) -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.rand(8, 6 * group, generator=g) * 0.5 + 0.1  # positive groups
    w[1] = -w[1]  # negative groups
    w[2] = 0.3  # constant
    w[3] = -0.2
    w[4] = 0.0  # span 0 -> clamped at RANGE_EPS
    w[5, :group] = -0.0
    w[6] = torch.randn(6 * group, generator=g) * 1e-6  # span < RANGE_EPS
    w[7] = torch.randn(6 * group, generator=g) * 3e-4  # scales around the FP16 subnormal edge
    for dtype in DTYPES:
        check_awq(w.to(dtype), group)


@pytest.mark.parametrize("s", [2.0**-7, 0.01171875, 2.0**-20, 1000.0])
def test_awq_ties(native: None, s: float) -> None:
    """Groups spanning exactly 15 * s (s an FP16 value, so it is the scale): w / s = m + 0.5 ties
    to even, and a zero point lo / s = -6.5 ties too."""
    m = torch.arange(-7, 8, dtype=torch.float64)  # (15,)
    ties = ((m + 0.5) * s).float()
    row_a = torch.cat([torch.tensor([-7 * s, 8 * s]), ties]).float()  # z = 7
    row_b = torch.cat([torch.tensor([-6.5 * s, 8.5 * s]), ties[1:]]).float()  # z ties: 6
    rows = [torch.cat([r, torch.full((128 - len(r),), float(s))]) for r in (row_a, row_b)]
    w = torch.stack(rows * 4)  # (8, 128)
    check_awq(w, 128)
    check_awq(torch.cat([w, w], dim=1), 64)


def test_awq_into_declines_bad_targets(native: None) -> None:
    """``awq_rtn_array(out=, row0=)`` returns None (the caller raises NotNative, the torch code
    runs) for a target it cannot fill exactly, and writes nothing then."""
    rows = Q.host_array(_normal(16, 256, seed=12, dtype=torch.bfloat16))
    assert rows is not None

    def out(nt: int = 32, k: int = 256) -> dict[str, np.ndarray]:
        shapes = {"qweight": (k, nt // 8), "qzeros": (k // 128, nt // 8), "scales": (k // 128, nt)}
        dtypes = {"qweight": np.int32, "qzeros": np.int32, "scales": np.float16}
        return {key: np.zeros(s, dtypes[key]) for key, s in shapes.items()}

    assert Q.awq_rtn_array(rows, 128, out=out(), row0=16) is not None  # the last 16 of 32 rows
    assert Q.awq_rtn_array(rows, 128, out=out(), row0=4) is None  # not a whole 8-row word
    assert Q.awq_rtn_array(rows, 128, out=out(), row0=24) is None  # past the weight's rows
    assert Q.awq_rtn_array(rows, 128, out=out(), row0=-8) is None
    assert Q.awq_rtn_array(rows, 128, out=out(k=512)) is None  # another K
    bad = out()
    bad["scales"] = bad["scales"].astype(np.float32)
    assert Q.awq_rtn_array(rows, 128, out=bad) is None
    bad = out()
    bad["qweight"] = np.zeros((32, 256), np.int32).T  # right shape, not C-contiguous
    assert Q.awq_rtn_array(rows, 128, out=bad) is None
    bad = out()
    del bad["qzeros"]
    assert Q.awq_rtn_array(rows, 128, out=bad) is None
    bad = out(nt=36)  # rows not a multiple of 8
    assert Q.awq_rtn_array(rows, 128, out=bad) is None
    assert all(not v.any() for v in bad.values())


def test_awq_overflow_and_nan_raise(native: None) -> None:
    fmt = AwqW4A16()
    huge = torch.full((8, 128), 1e6)
    huge[:, 0] = -1e6
    with pytest.raises(HetquantError, match="FP16 range"):
        fmt.quantize(huge)
    assert Q.awq_rtn(huge, 128) is None
    w = _normal(8, 256, seed=10, dtype=torch.float32)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w[5, 200] = bad
        for dtype in DTYPES:
            with pytest.raises(HetquantError, match="NaN or Inf"):
                fmt.quantize(w.to(dtype))


# ---- fallbacks -----------------------------------------------------------------------------------


def test_backend_torch_env_gives_the_same_bytes(native: None, monkeypatch, fresh_kernels) -> None:
    w = _normal(16, 256, seed=11, dtype=torch.bfloat16)
    outs = [(Nvfp4(), {"weight_amax": 0.1}), (_KMajorChunks(), {}), (AwqW4A16(group_size=64), {})]
    native_out = [fmt.quantize(w, **opts) for fmt, opts in outs]
    monkeypatch.setenv("HETQUANT_QUANT_BACKEND", "torch")
    Q.QUANT_LIBRARY.reset()
    assert not Q.available() and "HETQUANT_QUANT_BACKEND" in Q.QUANT_LIBRARY.get().error
    assert Q.nvfp4(w, 1.0, False) is None and Q.awq_rtn(w, 64) is None
    for (fmt, opts), want in zip(outs, native_out, strict=True):
        assert_same(fmt.quantize(w, **opts), want)


def test_failed_build_falls_back(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("HETQUANT_CACHE_DIR", str(tmp_path))
    missing = NativeLibrary("quant", Q._SOURCE, Q._bind, compiler="no-such-c++-compiler")
    built = missing.build()
    assert built.lib is None and "not found" in built.error
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    failing = NativeLibrary("quant", Q._SOURCE, Q._bind, label="quantize kernels")
    with caplog.at_level(logging.WARNING, logger="hetquant.native"):
        assert failing.get().lib is None and "false failed" in failing.get().error
    assert sum("native kernel unavailable" in r.message for r in caplog.records) == 1  # once
    monkeypatch.setattr(Q, "QUANT_LIBRARY", failing)
    w = _normal(8, 128, seed=12, dtype=torch.float32)
    assert_same(Nvfp4().quantize(w), Nvfp4()._quantize_torch(w, None))
    assert_same(AwqW4A16().quantize(w), AwqW4A16()._quantize_torch(w))


def test_build_is_cached_and_compile_errors_reported(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HETQUANT_CACHE_DIR", str(tmp_path))

    def bind(lib: ctypes.CDLL) -> None:
        lib.hq_answer.restype = ctypes.c_int

    src = 'extern "C" int hq_answer(void) { return 42; }\n'
    first = NativeLibrary("probe", src, bind).build()
    if first.lib is None:
        pytest.skip(f"no working C++ compiler: {first.error}")
    assert first.lib.hq_answer() == 42 and first.compile_s is not None
    again = NativeLibrary("probe", src, bind).build()
    assert again.path == first.path and again.compile_s is None  # from the cache
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files
    broken = NativeLibrary("probe", src + "not C++\n", bind).build()
    assert broken.lib is None and "failed" in broken.error
    unbound = NativeLibrary("probe", src, lambda lib: lib.hq_missing).build()
    assert unbound.lib is None and "cannot load" in unbound.error


@pytest.mark.parametrize(("k", "n"), [(64, 256), (128, 512), (192, 2048), (7168, 256)])
def test_nvfp4_tile_is_the_torch_permutation(native: None, k: int, n: int) -> None:
    """The C++ tile gather (nvfp4_ascend_tiles.tile) moves every byte where the 8-D permute does."""
    from hetquant.formats.nvfp4_ascend_tiles import tile, tile_torch, untile

    kn = torch.randint(0, 256, (k, n // 2), generator=torch.Generator().manual_seed(k + n), dtype=torch.uint8)  # fmt: skip
    tiled = Q.nvfp4_tile(kn)
    assert tiled is not None and torch.equal(tiled, tile_torch(kn))
    assert torch.equal(tile(kn), tiled) and torch.equal(untile(tiled), kn)
    assert Q.nvfp4_tile(kn.T) is None and Q.nvfp4_tile(kn.to(torch.int16)) is None  # torch path


@pytest.mark.parametrize("rows", [0, 1, 127, 128])
def test_u8_colmax7_is_the_torch_reduction(native: None, rows: int) -> None:
    """Column max of the low 7 bits (fp8_block.absmax_dequantized), strided rows included."""
    g = torch.Generator().manual_seed(rows)
    full = torch.randint(0, 256, (rows, 300), generator=g, dtype=torch.uint8)
    for view in (full, full[:, :257]):  # the second: rows strided past their columns
        got = Q.u8_colmax7(view.view(torch.float8_e4m3fn))
        want = (view & 0x7F).amax(dim=0) if rows else torch.zeros(view.shape[1], dtype=torch.uint8)
        assert got is not None and torch.equal(got, want)
    assert Q.u8_colmax7(full.T) is None  # columns not contiguous: the torch path


def test_scale_2_of_a_float_is_the_torch_value() -> None:
    """nvfp4_codes.scale_2_of (numpy scalars, per streamed row block) == scale_2_from_amax bit for
    bit: zero, the float32 subnormal range, values that round when cast to float32, huge ones."""
    import random

    from hetquant.formats.nvfp4_codes import scale_2_from_amax, scale_2_of

    rng = random.Random(30)
    values = [0.0, 1e-45, 2.0**-149, 448.0, 2688.0, 3.0e38, 1 + 2.0**-30, 7.123456789]
    values += [rng.uniform(0, 10) ** rng.uniform(-12, 12) for _ in range(5000)]
    for v in values:
        got, want = scale_2_of(v), scale_2_from_amax(torch.as_tensor(v))
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == ()
        assert got.view(torch.int32).item() == want.view(torch.int32).item(), v


@pytest.mark.parametrize("chunk", [32, 96, 256, 2048])
def test_nvfp4_tile_into_chunks_is_the_whole_tiling(native: None, chunk: int) -> None:
    """Chunks of byte columns placed one by one (the streamed tiled layout) give tile's bytes;
    columns not in whole 16-byte runs are declined, leaving the output untouched."""
    from hetquant.formats.nvfp4_ascend_tiles import tile_torch

    k, nb = 128, 1024
    kn = torch.randint(0, 256, (k, nb), generator=torch.Generator().manual_seed(chunk), dtype=torch.uint8)  # fmt: skip
    out = torch.zeros_like(kn)
    for c in range(0, nb, chunk // 2):
        assert Q.nvfp4_tile_into(kn[:, c : c + chunk // 2].contiguous(), c, out)
    assert torch.equal(out, tile_torch(kn))
    untouched = torch.zeros_like(kn)
    assert not Q.nvfp4_tile_into(kn[:, 8:28].contiguous(), 8, untouched)
    assert not untouched.any()
