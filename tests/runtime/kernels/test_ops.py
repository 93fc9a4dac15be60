"""``QuantLinear`` on every (format, backend) pair against dequantize-then-matmul, within a bound.

The npu backend runs on ``hetquant.runtime.kernels.npu_emulation`` here: a CPU emulation of torch_npu's
documented op contracts, not Ascend hardware.

Reference: ``y_ref = x @ W.T`` in float64 with ``W = fmt.dequantize(stored)``, the format's own
definition of the weight. Every kernel computes ``y = fl_out(Σ_k x̃_k W̃_nk (1 + θ))`` where

* ``x̃ = x + e``: activation quantization, ``|e_k| <= e_k`` (0 for weight-only formats);
* ``W̃ = W + δ``: what the kernel multiplies instead of W (scales held in BF16/FP16, a BF16
  weight), ``|δ_nk| <= E_nk``;
* ``θ``: the accumulation and scaling error, ``|θ| <= γ + u_s``. F32 summation of K terms gives
  ``γ_K = K u / (1 - K u)`` (u = 2^-24, any order); an exact int32 sum followed by at most three
  F32 multiplies gives ``4u``; ``u_s`` is the relative error of a scale held in a lower precision;
* ``fl_out``: one rounding to the output dtype, unit roundoff u_out (2^-8 BF16, 2^-11 FP16,
  2^-24 F32), plus an absolute η (half the smallest subnormal) for underflow.

Since ``x̃W̃ - xW = eW + (x + e)δ``, with ``S = Σ_k (|x_k| + e_k)(|W_nk| + E_nk)``::

    |y - y_ref| <= err + u_out (|y_ref| + err) + η,
    err = (1 + 10^-3) [Σ_k e_k |W_nk| + Σ_k (|x_k| + e_k) E_nk + (γ + u_s) S]

(the factor absorbs second-order products such as γ·u_s). Per path, from the kernels' docstrings:

* W8A8_DYNAMIC, r = fl(127/amax), q = rint(fl(x r)), s_x = fl(1/r):
  ``e_k = (amax/127)(1 + 4u)/2 + 3u|x_k|``, E = 0, γ = 4u; u_s = 2^-8 on npu with BF16 x (the
  weight scale is held in BF16, as vllm-ascend does), else 0.
* W8A8 static within the calibrated range (no clamping): x_q - z = x recip' + η with
  |η| <= 1/2 + 2^-14, so ``e_k = input_scale (1/2 + 2^-14)``; recip' = 1/s_in up to the precision
  the input scale is held in (d = x.dtype on npu, F32 on cpu): u_s = 2u_d + u_d^2 + 4u.
* int4 through tinygemm in dtype d (scale s and zero (8 - z) s rounded to d, the weight possibly
  rounded to d once more): ``E = u_d (1 + u_d)(|u - 8| + |8 - z|) s + u_d |W|``, γ = γ_K.
* npu_weight_quant_batchmatmul (emulated: (w + offset) * scale in F32, scale cast to d, result
  rounded to d): ``E = (2u_d + u_d^2)|W|``, γ = γ_K.
* soft FP4 on npu: BF16 scale fold, then a BF16 weight: ``E = (2u_b + u_b^2 + 4u)|W|``.
* dequantize fallback and bf16: E = 0, γ = γ_K. CUDA tinygemm rounds x to BF16: e = 2^-8 |x|.

Bit-exact checks: the cpu int8 kernels equal ``formats.w8a8_npu.dynamic_quant_matmul`` /
``static_quant_matmul``, and the npu path equals them with ``param_dtype`` = the dtype vllm-ascend
holds the scales in.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from hetquant.formats import FORMATS, HetquantError, get_format
from hetquant.formats.awq_w4a16 import AWQ_ORDER
from hetquant.formats.bits import unpack_nibbles_i32
from hetquant.formats.w4a8_npu import unpack_out_pairs
from hetquant.formats.w8a8_npu import dynamic_quant_matmul, static_quant_matmul
from hetquant.runtime.kernels import npu_emulation as emu
from hetquant.runtime.kernels.backends import npu as npu_backend
from hetquant.runtime.kernels.ops import KERNELS, QuantLinear

BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
U = {BF16: 2.0**-8, FP16: 2.0**-11, F32: 2.0**-24}
ETA = {BF16: 2.0**-134, FP16: 2.0**-25, F32: 2.0**-150}
U32 = U[F32]
ACT_RANGE = (-3.0, 5.0)  # calibrated input range of the static W8A8 weights


@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    n: int = 128
    k: int = 256
    params: tuple = ()

    @property
    def id(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in self.params)
        return f"{self.fmt}{extra}-{self.n}x{self.k}"


CASES = [
    Case("bf16"),
    Case("w8a8_dynamic"),
    Case("w8a8_dynamic", n=60, k=100),  # cuda: in % 8 != 0 -> exact float64 fallback
    Case("w8a8"),
    Case("w4a8_dynamic"),
    Case("w4a8_dynamic", n=64, k=96, params=(("bias_chunks", 16),)),
    Case("awq_w4a16"),
    Case("awq_w4a16", params=(("group_size", 64),)),
    Case("awq_w4a16", n=72, k=128),  # one group (npu per-channel mode); cpu falls back (72 % 16)
    Case("ct_pack_quantized"),
    Case("ct_pack_quantized", params=(("group_size", 32),)),
    Case("int4_cpu"),
    Case("int4_cpu", n=64, k=100),  # in % 32 != 0: cpu falls back to dequantize
    Case("nvfp4"),
    Case("nvfp4_ascend", n=256, k=128),
]
NPU_DTYPES = {"nvfp4": (BF16,), "nvfp4_ascend": (BF16,)}


def stored(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(case.n, case.k, generator=g) * torch.logspace(-2, 0, case.n)[:, None]
    w[0, :4] = torch.tensor([3.0, -2.5, 0.0, 1e-4])  # outliers and tiny values
    opts = dict(zip(("act_min", "act_max"), ACT_RANGE, strict=True)) if case.fmt == "w8a8" else {}
    return get_format(case.fmt, **dict(case.params)).quantize(w, **opts)


def activations(case: Case, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if case.fmt == "w8a8":  # stay inside the calibrated range (no clamping)
        lo, hi = (0.9 * a for a in ACT_RANGE)
        x = lo + (hi - lo) * torch.rand(2, 3, case.k, generator=g)
    else:
        x = torch.randn(2, 3, case.k, generator=g) * 2
        x[1, 2, 5] = 40.0  # an outlier token
    x[0, 0] = 0.0  # an all-zero token
    return x.to(dtype)


def gamma_k(k: int) -> float:
    return k * U32 / (1 - k * U32)


def assert_within(y, y_ref, x, w, *, e=None, E=None, gamma, u_s=0.0) -> float:
    """Assert the module docstring's bound elementwise; return max |y - y_ref| / bound."""
    xa = x.double().abs().reshape(-1, w.shape[1])
    wa = w.double().abs()
    e = torch.zeros_like(xa) if e is None else e.double().reshape(xa.shape)
    E = torch.zeros_like(wa) if E is None else E.double()
    err = e @ wa.T + (xa + e) @ E.T + (gamma + u_s) * ((xa + e) @ (wa + E).T)
    err = (1 + 1e-3) * err
    ref = y_ref.reshape(err.shape)
    bound = err + U[y.dtype] * (ref.abs() + err) + ETA[y.dtype]
    diff = (y.double().reshape(err.shape) - ref).abs()
    ratio = diff / bound
    assert bool((ratio <= 1).all()), f"max |y - y_ref| / bound = {ratio.max().item():.3g}"
    return ratio.max().item()


def int4_terms(fmt, t, w: torch.Tensor):
    """(|u - 8| s, |8 - z| s) as [N, K] float64 for the three int4 formats (tinygemm form)."""
    if fmt.name == "awq_w4a16":
        g = fmt.group_size
        u = unpack_nibbles_i32(t["qweight"], AWQ_ORDER).double().T
        z = unpack_nibbles_i32(t["qzeros"], AWQ_ORDER).double().repeat_interleave(g, 0).T
        s = t["scales"].double().repeat_interleave(g, 0).T
        return (u - 8).abs() * s, (8 - z).abs() * s
    return w.double().abs(), torch.zeros_like(w, dtype=torch.float64)


def spec(case, backend, lin, t, x, w, y_dtype, *, cuda=False):
    """(e, E, gamma, u_s) for this path, as derived in the module docstring."""
    fmt = get_format(case.fmt, **dict(case.params))
    xa, wa, k = x.double().abs().reshape(-1, case.k), w.double().abs(), case.k
    if case.fmt in ("w8a8_dynamic", "w4a8_dynamic"):  # w4a8: the w8a8 kernel on widened codes
        amax = xa.amax(dim=1, keepdim=True)
        e = (amax / 127) * (1 + 4 * U32) / 2 + 3 * U32 * xa
        u_s = U[BF16] if backend == "npu" and x.dtype == BF16 else 0.0
        return e, None, 4 * U32, u_s
    if case.fmt == "w8a8":
        e = torch.full_like(xa, float(t["input_scale"]) * (0.5 + 2.0**-14))
        ud = U[x.dtype] if backend == "npu" else U32
        return e, None, 4 * U32, 2 * ud + ud * ud + 4 * U32
    if lin.uses.startswith("dequantize"):
        return None, None, gamma_k(k), 0.0  # the fallback: the format's own F32 weight
    if "_weight_int4pack_mm" in lin.uses:
        d = BF16 if cuda else x.dtype
        a, b = int4_terms(fmt, t, w)
        E = U[d] * (1 + U[d]) * (a + b) + U[d] * wa
        e = U[BF16] * xa if cuda and x.dtype != BF16 else None
        return e, E, gamma_k(k), 0.0
    if "npu_weight_quant_batchmatmul" in lin.uses:
        ud = U[x.dtype]
        return None, (2 * ud + ud * ud) * wa, gamma_k(k), 0.0
    if "soft FP4" in lin.uses:
        ub = U[BF16]
        return None, (2 * ub + ub * ub + 4 * U32) * wa, gamma_k(k), 0.0
    return None, None, gamma_k(k), 0.0  # bf16, dequantize fallback


def npu_linear(fmt, t, **kw) -> QuantLinear:
    return QuantLinear.from_stored(fmt, t, backend="npu", npu_ops=emu, **kw)


PAIRS = [
    pytest.param(case, backend, dtype, id=f"{case.id}-{backend}-{str(dtype)[6:]}")
    for case in CASES
    for backend in ("cpu", "npu")
    if not (backend == "npu" and case.fmt == "int4_cpu")
    for dtype in ((BF16, FP16, F32) if backend == "cpu" else NPU_DTYPES.get(case.fmt, (BF16, FP16)))
]


@pytest.mark.parametrize(("case", "backend", "dtype"), PAIRS)
def test_pair_matches_dequantize_then_matmul(case: Case, backend: str, dtype: torch.dtype) -> None:
    t = stored(case)
    fmt = get_format(case.fmt, **dict(case.params))
    w = fmt.dequantize(t)  # (N, K) F32
    x = activations(case, dtype)
    ops = {"npu_ops": emu} if backend == "npu" else {}
    lin = QuantLinear.from_stored(case.fmt, t, backend=backend, params=dict(case.params), **ops)
    y = lin(x)
    assert y.shape == (2, 3, case.n) and y.dtype == dtype
    y_ref = x.double() @ w.double().T
    e, E, gamma, u_s = spec(case, backend, lin, t, x, w, dtype)
    assert_within(y, y_ref, x, w, e=e, E=E, gamma=gamma, u_s=u_s)
    assert bool((y[0, 0] == 0).all())  # the all-zero token


def test_fallbacks_are_named() -> None:
    awq = Case("awq_w4a16", n=72, k=128)
    assert "dequantize" in QuantLinear.from_stored("awq_w4a16", stored(awq), backend="cpu").uses
    i4 = Case("int4_cpu", n=64, k=100)
    assert "dequantize" in QuantLinear.from_stored("int4_cpu", stored(i4), backend="cpu").uses
    assert (
        "_weight_int4pack_mm_for_cpu"
        in QuantLinear.from_stored("int4_cpu", stored(Case("int4_cpu")), backend="cpu").uses
    )


@pytest.mark.parametrize("dtype", [BF16, FP16, F32])
def test_cpu_int8_bit_exact_against_reference(dtype: torch.dtype) -> None:
    for case, ref in (
        (Case("w8a8_dynamic"), dynamic_quant_matmul),
        (Case("w8a8"), static_quant_matmul),
    ):
        t, x = stored(case), activations(case, dtype)
        y = QuantLinear.from_stored(case.fmt, t, backend="cpu")(x)
        assert torch.equal(y, ref(x, t))


@pytest.mark.parametrize("backend", ["cpu", "npu"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_w4a8_is_w8a8_dynamic_on_the_widened_codes(backend: str, dtype: torch.dtype) -> None:
    case = Case("w4a8_dynamic", params=(("bias_chunks", 16),))
    t, x = stored(case), activations(case, dtype)
    widened = {k: v for k, v in t.items() if k != "scale_bias"}
    widened["weight"] = unpack_out_pairs(t["weight"])
    ops = {"npu_ops": emu} if backend == "npu" else {}
    got = QuantLinear.from_stored(case.fmt, t, backend=backend, params=dict(case.params), **ops)
    want = QuantLinear.from_stored("w8a8_dynamic", widened, backend=backend, **ops)
    assert "widened" in got.uses and torch.equal(got(x), want(x))
    bad = dict(t, scale_bias=t["scale_bias"] * 2)  # a corrupt artifact is refused at load
    with pytest.raises(HetquantError, match="scale_bias disagrees"):
        QuantLinear.from_stored(case.fmt, bad, backend=backend, params=dict(case.params), **ops)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_npu_int8_bit_exact_against_reference(dtype: torch.dtype) -> None:
    case = Case("w8a8_dynamic")
    t, x = stored(case), activations(case, dtype)
    scale_dtype = BF16 if dtype == BF16 else None  # vllm-ascend's weight_scale vs _fp32
    assert torch.equal(
        npu_linear(case.fmt, t)(x), dynamic_quant_matmul(x, t, param_dtype=scale_dtype)
    )
    case = Case("w8a8")
    t, x = stored(case), activations(case, dtype)
    assert torch.equal(npu_linear(case.fmt, t)(x), static_quant_matmul(x, t, param_dtype=dtype))


def test_npu_w8a8_prepared_as_vllm_ascend() -> None:
    t = stored(Case("w8a8_dynamic"))
    p = npu_linear("w8a8_dynamic", t).kernel.prepared
    assert torch.equal(p["weight"], t["weight"].T)  # [K, N]
    assert emu.get_npu_format(p["weight"]) == emu.ACL_FORMAT_FRACTAL_NZ
    assert p["weight_scale"].dtype == BF16 and p["weight_scale"].shape == (128,)
    assert torch.equal(p["weight_scale_fp32"], t["weight_scale"].reshape(-1))
    t = stored(Case("w8a8"))
    p = npu_linear("w8a8", t).kernel.prepared
    assert torch.equal(p["quant_bias"], t["quant_bias"]) and p["deq_scale"].dtype == F32


def test_npu_splits_n_above_the_op_limit() -> None:
    case = Case("w8a8_dynamic", n=65544, k=32)
    t, x = stored(case), activations(case, FP16)
    lin = npu_linear(case.fmt, t)
    assert "2 part(s)" in lin.uses
    assert torch.equal(lin(x), QuantLinear.from_stored(case.fmt, t, backend="cpu")(x))


@pytest.mark.parametrize("backend", ["cpu", "npu"])
def test_static_quant_bias_on_rank_0_only(backend: str) -> None:
    case = Case("w8a8")
    t, x = stored(case), activations(case, BF16)
    ops = {"npu_ops": emu} if backend == "npu" else {}
    lin = QuantLinear.from_stored("w8a8", t, backend=backend, tp_rank=1, **ops)
    assert "quant_bias" not in lin.kernel.prepared
    no_bias = {**t, "quant_bias": torch.zeros_like(t["quant_bias"])}
    param_dtype = BF16 if backend == "npu" else None
    assert torch.equal(lin(x), static_quant_matmul(x, no_bias, param_dtype=param_dtype))


def test_awq_wrong_nibble_order_breaks_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the bound is tight enough to catch a repack that skips the reorder."""
    case = Case("awq_w4a16")
    t, x = stored(case), activations(case, BF16)
    w = get_format(case.fmt).dequantize(t)
    monkeypatch.setattr(npu_backend, "awq_to_int4pack", lambda q: q ^ -0x77777778)  # XOR only
    lin = npu_linear(case.fmt, t)
    _, E, gamma, _ = spec(case, "npu", lin, t, x, w, BF16)
    with pytest.raises(AssertionError, match="bound"):
        assert_within(lin(x), x.double() @ w.double().T, x, w, E=E, gamma=gamma)


# -- API ----------------------------------------------------------------------------------------


def test_shapes_and_empty_batch() -> None:
    t = stored(Case("w8a8_dynamic"))
    lin = QuantLinear.from_stored("w8a8_dynamic", t, backend="cpu")
    assert (lin.in_features, lin.out_features) == (256, 128)
    assert lin(torch.randn(256)).shape == (128,)
    assert lin(torch.randn(4, 1, 2, 256)).shape == (4, 1, 2, 128)
    assert lin(torch.randn(0, 256)).shape == (0, 128)
    assert "QuantLinear(w8a8_dynamic, cpu" in repr(lin)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: QuantLinear.from_stored("nope", {}, backend="cpu"), "unknown format"),
        (lambda: QuantLinear.from_stored("bf16", {}, backend="tpu"), "unknown backend"),
        (lambda: QuantLinear.from_stored("fp8_block", {}, backend="cpu"), "no cpu kernel"),
        (
            lambda: QuantLinear.from_stored("awq_w4a16", {}, backend="cpu", params={"bits": 3}),
            "bad format params",
        ),
        (
            lambda: QuantLinear.from_stored(
                "awq_w4a16", {}, backend="cpu", params={"group_size": 7}
            ),
            "group_size",
        ),
        (
            lambda: QuantLinear.from_stored("bf16", {}, backend="cpu"),
            "cannot read the weight shape",
        ),
        (
            lambda: QuantLinear.from_stored(
                "bf16", {"weight": torch.ones(2, 2)}, backend="cpu", npu_ops=emu
            ),
            "npu_ops",
        ),
        (lambda: npu_linear("int4_cpu", stored(Case("int4_cpu"))), "CPU expert pool"),
    ],
)
def test_construction_errors(make, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        make()


def test_bad_stored_tensors_are_refused() -> None:
    t = stored(Case("w8a8_dynamic"))
    with pytest.raises(HetquantError, match="expected"):
        QuantLinear.from_stored(
            "w8a8_dynamic", {k: v for k, v in t.items() if k != "weight_offset"}, backend="cpu"
        )
    with pytest.raises(HetquantError, match="NaN"):
        QuantLinear.from_stored(
            "w8a8_dynamic", {**t, "weight_scale": t["weight_scale"] * float("nan")}, backend="cpu"
        )
    with pytest.raises(HetquantError, match="weight_offset"):
        npu_linear("w8a8_dynamic", {**t, "weight_offset": t["weight_offset"] + 1})
    ct = stored(Case("ct_pack_quantized"))
    with pytest.raises(HetquantError, match="weight_shape"):
        QuantLinear.from_stored(
            "ct_pack_quantized", {**ct, "weight_shape": torch.tensor([128, 128])}, backend="cpu"
        )


def test_call_errors() -> None:
    cpu = QuantLinear.from_stored("w8a8_dynamic", stored(Case("w8a8_dynamic")), backend="cpu")
    with pytest.raises(HetquantError, match=r"expected x \[\.\.\., 256\]"):
        cpu(torch.randn(3, 255))
    with pytest.raises(HetquantError, match="float64"):
        cpu(torch.randn(3, 256, dtype=torch.float64))
    with pytest.raises(HetquantError, match="NaN"):
        cpu(torch.full((1, 256), float("nan")))
    npu = npu_linear("w8a8_dynamic", stored(Case("w8a8_dynamic")))
    with pytest.raises(HetquantError, match="bfloat16"):
        npu(torch.randn(3, 256))  # npu_dynamic_quant takes fp16/bf16 only


def test_npu_without_torch_npu_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(HetquantError, match=r"npu_ops=hetquant\.runtime\.kernels\.npu_emulation"):
        QuantLinear.from_stored("bf16", {"weight": torch.ones(8, 8, dtype=BF16)}, backend="npu")


def test_cuda_absent_raises_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(HetquantError, match="no CUDA device"):
        QuantLinear.from_stored("bf16", {"weight": torch.ones(8, 8, dtype=BF16)}, backend="cuda")


def test_registry_covers_every_runtime_format() -> None:
    # the source formats are converted, not served (DeepSeek-V3's FP8, DeepSeek-V4's FP8 and FP4)
    runtime_formats = set(FORMATS) - {"fp8_block", "fp8_block_scale", "fp4_e2m1"}
    assert {f for f, _ in KERNELS} == runtime_formats
    assert {(f, b) for f in runtime_formats for b in ("cpu", "cuda", "npu")} == set(KERNELS)


def test_runtime_does_not_import_convert() -> None:
    code = (
        "import sys, hetquant.runtime.kernels.ops, hetquant.runtime.kernels.npu_emulation;"
        "bad = [m for m in sys.modules if m.startswith('hetquant.convert')];"
        "sys.exit(repr(bad) if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# -- CUDA (skipped without a GPU) -----------------------------------------------------------------

CUDA_PAIRS = [
    pytest.param(case, dtype, id=f"{case.id}-{str(dtype)[6:]}")
    for case in CASES
    for dtype in (BF16, FP16)
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("case", "dtype"), CUDA_PAIRS)
def test_cuda_pair_matches_dequantize_then_matmul(case: Case, dtype: torch.dtype) -> None:
    t = stored(case)
    fmt = get_format(case.fmt, **dict(case.params))
    w, x = fmt.dequantize(t), activations(case, dtype)
    on_gpu = {key: v.cuda() for key, v in t.items()}  # as the loader delivers them
    lin = QuantLinear.from_stored(case.fmt, on_gpu, backend="cuda", params=dict(case.params))
    y = lin(x.cuda()).cpu()
    e, E, gamma, u_s = spec(case, "cuda", lin, t, x, w, dtype, cuda=True)
    assert_within(y, x.double() @ w.double().T, x, w, e=e, E=E, gamma=gamma, u_s=u_s)
    reference = {"w8a8_dynamic": dynamic_quant_matmul, "w8a8": static_quant_matmul}.get(case.fmt)
    if reference is not None:  # the integer kernels reproduce the reference bit for bit
        assert torch.equal(y, reference(x, t))
