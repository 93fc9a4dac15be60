"""CPU expert pool and INT4 GEMV: against the int4_cpu reference, across subpools, zero-copy.

Tolerances are derived, not tuned (``int4_gemv`` module docstring). For one GEMV of the native
kernel, with ``q = c − 8`` and ``|W| = s·|q|``::

    |ŷ − y| ≤ (|W|·1) · amax|x| · 2^-22  +  2^-24·|y|              (fixed-point x, one rounding)

and of the torch path ``(K/2 + 2)·2^-24 · (|W|·|x|)`` (float32 dot products). The reference,
``formats.int4_cpu.expert_forward`` on float64 ``x``, multiplies weights dequantized in float32
(``(c − 8)·s`` rounded: relative 2^-24 each), which adds ``2^-24·|W|·|x|``. One expert
``y = D·(silu(G x) ⊙ U x)`` then carries, to first order (``silu' ≤ 1.1``, float32 silu and
product: 8 ulp of ``|act|``)::

    Δg, Δu  = GEMV bound of G, U on x
    Δact    ≤ 1.1·Δg·|u| + |silu g|·Δu + Δg·Δu + 2^-21·|act|
    Δy      ≤ |D|·Δact + GEMV bound of D on act

and the routed sum ``Σ_k w_k y_k`` adds ``(k·S + 1)·2^-24·Σ|w_k y_k|`` for float32 additions
(S subpool partials), and a bf16 result ``2^-8·|out|``. Tests assert ``error ≤ 2 × bound``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gemv_reference import (
    U,
    assert_within,
    expert_bound,
    gemv_bound,
    gemv_ref,
    routed_ref_and_bound,
    routing,
)

from hetquant.formats import HetquantError
from hetquant.formats.int4_cpu import (
    LAYER_KEYS,
    expert_forward,
    quantize_expert,
    stack_experts,
    subpool_slice,
)
from hetquant.runtime.experts.expert_pool import CpuExpertPool
from hetquant.runtime.kernels import int4_gemv as G

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-deepseek-v3"


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid: Path) -> Path:
    """The ascend-hybrid artifact of the tiny model (read-only for tests)."""
    return tiny_hybrid


@pytest.fixture(scope="module")
def layer_tensors(hybrid: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every cpu_experts layer, read with safetensors (independently of the pool)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted((hybrid / "cpu_experts").glob("*.safetensors")):
        tensors = load_file(str(f))
        prefix = next(iter(tensors)).rsplit(".", 1)[0]
        layer = int(prefix.split("layers.")[1].split(".")[0])
        out[layer] = {k: tensors[f"{prefix}.{k}"] for k in LAYER_KEYS}
    return out


@pytest.fixture
def native_or_skip():
    if not G.native_available():
        pytest.skip(f"native int4 kernel unavailable: {G.native_info()['error']}")


# ------------------------------------------------------------------------------------------------
# the pool


CASES = [
    (1, "inter", False),
    (2, "inter", False),
    (4, "inter", True),
    (3, "experts", False),
    (8, "experts", True),
]


@pytest.mark.parametrize(("subpools", "split", "materialize"), CASES)
def test_forward_matches_reference(hybrid, layer_tensors, subpools, split, materialize):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    with CpuExpertPool.open(
        hybrid, subpools=subpools, split=split, materialize=materialize
    ) as pool:
        assert pool.layers == sorted(layer_tensors)
        for layer in pool.layers:
            info = pool.info(layer)
            ids, w = routing(5, info.num_experts, 2, seed=layer)
            got = pool.forward(layer, x, ids, w)
            assert got.dtype == torch.float32 and got.shape == x.shape
            ref, bound = routed_ref_and_bound(layer_tensors[layer], x, ids, w, subpools)
            assert_within(got, ref, bound)


def test_bf16_in_bf16_out(hybrid, layer_tensors):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    with CpuExpertPool.open(hybrid, subpools=2) as pool:
        layer = pool.layers[0]
        ids, w = routing(7, 8, 2, seed=3)
        got = pool.forward(layer, x, ids, w)
        assert got.dtype == torch.bfloat16
        ref, bound = routed_ref_and_bound(layer_tensors[layer], x, ids, w, 2)
        assert_within(got, ref, bound)


def test_subpools_and_splits_agree(hybrid, layer_tensors):
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    layer = min(layer_tensors)
    ids, w = routing(9, 8, 2, seed=5)
    outs = {}
    for s, split in [(1, "inter"), (2, "inter"), (4, "inter"), (2, "experts"), (8, "experts")]:
        with CpuExpertPool.open(hybrid, subpools=s, split=split, layers=[layer]) as pool:
            outs[(s, split)] = pool.forward(layer, x, ids, w)
    ref, bound = routed_ref_and_bound(layer_tensors[layer], x, ids, w, 4)
    base = outs[(1, "inter")]
    for key, y in outs.items():
        # each is within the bound of the exact value, so two differ by at most twice that
        assert ((y.double() - base.double()).abs() <= 4 * bound).all(), key
        assert_within(y, ref, bound)


@pytest.mark.parametrize(("subpools", "split", "dtype"), [(1, "inter", torch.bfloat16),
                                                       (2, "inter", torch.float32),
                                                       (3, "experts", torch.float16)])  # fmt: skip
def test_fused_call_gives_the_per_expert_loops_bits(hybrid, subpools, split, dtype):
    g = torch.Generator().manual_seed(subpools)
    x = (torch.randn(11, 256, generator=g) * 3).to(dtype)
    ids, w = routing(11, 8, 3, seed=7)
    outs = []
    for fused in (True, False):
        with CpuExpertPool.open(hybrid, subpools=subpools, split=split, fused=fused) as pool:
            outs.append([pool.forward(layer, x, ids, w) for layer in pool.layers])
            outs[-1].append(pool.expert(pool.layers[0], 3, x))
    for a, b in zip(*outs, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


def test_one_expert(hybrid, layer_tensors):
    x = torch.randn(3, 4, 256, generator=torch.Generator().manual_seed(6))
    with CpuExpertPool.open(hybrid, subpools=4, layers=[2]) as pool:
        assert pool.layers == [2]
        for e in (0, 5, 7):
            got = pool.expert(2, e, x)
            assert got.shape == x.shape
            x64 = x.reshape(-1, 256).double()
            ref = expert_forward(layer_tensors[2], e, x64)
            bound = expert_bound(layer_tensors[2], e, x64) + 5 * U * ref.abs()
            assert_within(got.reshape(-1, 256), ref, bound)


def test_empty_and_bad_calls(hybrid):
    with CpuExpertPool.open(hybrid) as pool:
        layer = pool.layers[0]
        out = pool.forward(
            layer, torch.zeros(0, 256), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
        )
        assert out.shape == (0, 256)
        assert pool.expert(layer, 3, torch.zeros(0, 256)).shape == (0, 256)
        x = torch.randn(2, 256)
        ids = torch.tensor([[0, 8], [1, 2]])
        with pytest.raises(HetquantError, match="topk_ids outside"):
            pool.forward(layer, x, ids, torch.ones(2, 2))
        with pytest.raises(HetquantError, match="hidden"):
            pool.forward(layer, torch.randn(2, 255), ids.clamp(max=7), torch.ones(2, 2))
        with pytest.raises(HetquantError, match="not in the pool"):
            pool.expert(99, 0, x)
        with pytest.raises(HetquantError, match="float32, bfloat16"):
            pool.expert(layer, 0, x.to(torch.int32))
    with pytest.raises(HetquantError, match="closed"):
        pool.expert(layer, 0, x)


def test_zero_copy_views_share_the_mapping(hybrid):
    with CpuExpertPool.open(hybrid, subpools=2) as pool:
        ranges = pool.mapped_ranges()
        assert len(ranges) == len(pool.layers)
        for s in range(2):
            for layer in pool.layers:
                for key, t in pool.subpool_tensors(s, layer).items():
                    ptr = t.data_ptr()
                    hit = [r for r in ranges if r[0] <= ptr < r[1]]
                    assert hit, (s, layer, key)
                    base = t.untyped_storage().data_ptr()
                    assert base == hit[0][0], "a view of the whole-file mapping, not a copy"
        # inter split: subpool 1's gate/up rows start I/S·2 rows into expert 0
        t0 = pool.subpool_tensors(0, pool.layers[0])["gate_up_packed"]
        t1 = pool.subpool_tensors(1, pool.layers[0])["gate_up_packed"]
        assert t1.data_ptr() - t0.data_ptr() == 256 * 128  # 2·(I/2) rows of H/2 bytes
    with CpuExpertPool.open(hybrid, subpools=2, materialize=True) as pool:
        assert pool.mapped_ranges() == []
        t = pool.subpool_tensors(1, pool.layers[0])["down_packed"]
        assert t.is_contiguous() and t.shape == (8, 256, 64)


def test_views_match_subpool_slice(hybrid, layer_tensors):
    with CpuExpertPool.open(hybrid, subpools=4) as pool:
        for layer in pool.layers:
            for s in range(4):
                want = subpool_slice(layer_tensors[layer], s, 4)
                got = pool.subpool_tensors(s, layer)
                for k in LAYER_KEYS:
                    assert torch.equal(got[k], want[k]), (layer, s, k)
    with CpuExpertPool.open(hybrid, subpools=3, split="experts", materialize=True) as pool:
        layer = pool.layers[0]
        assert [pool.subpool_experts(s, layer) for s in range(3)] == [
            range(0, 2),
            range(2, 5),
            range(5, 8),
        ]
        got = pool.subpool_tensors(1, layer)["down_packed"]
        assert torch.equal(got, layer_tensors[layer]["down_packed"][2:5])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"subpools": 0}, "integer >= 1"),
        ({"subpools": -2}, "integer >= 1"),
        ({"subpools": 2.0}, "integer >= 1"),
        ({"subpools": True}, "integer >= 1"),
        ({"subpools": 3}, "cannot split moe intermediate 256"),
        ({"subpools": 256}, "cannot split moe intermediate 256"),
        ({"subpools": 9, "split": "experts"}, "at most one subpool per expert"),
        ({"split": "rows"}, "split"),
        ({"subpools": 2, "cpus": [[0]]}, "one non-empty CPU set per subpool"),
        ({"cpus": [[4096]]}, "not available to this process"),
        ({"layers": [0]}, r"no CPU experts for layer\(s\) \[0\]"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_open_arguments(hybrid, kwargs, match):
    with pytest.raises(HetquantError, match=match):
        CpuExpertPool.open(hybrid, **kwargs)


def test_manifest_errors(hybrid, tmp_path):
    with pytest.raises(HetquantError, match=r"no hetquant\.json"):
        CpuExpertPool.open(tmp_path)
    art = tmp_path / "art"
    shutil.copytree(hybrid, art)
    man = art / "hetquant.json"
    doc = json.loads(man.read_text())
    bad = json.loads(json.dumps(doc))
    bad["parts"]["cpu_experts"]["files"] = ["../../etc/passwd"]
    man.write_text(json.dumps(bad))
    with pytest.raises(HetquantError, match="outside the artifact"):
        CpuExpertPool.open(art)
    del bad["parts"]["cpu_experts"]
    man.write_text(json.dumps(bad))
    with pytest.raises(HetquantError, match="no cpu_experts part"):
        CpuExpertPool.open(art)
    doc["complete"] = False
    man.write_text(json.dumps(doc))
    with pytest.raises(HetquantError, match="not complete"):
        CpuExpertPool.open(art)


def test_pool_never_writes_the_files(hybrid):
    before = {p: p.read_bytes() for p in (hybrid / "cpu_experts").iterdir()}
    with CpuExpertPool.open(hybrid, subpools=2) as pool:
        t = pool.subpool_tensors(0, pool.layers[0])["gate_up_packed"]
        t[0, 0, 0] ^= 0xFF  # copy-on-write: private to this process
    assert {p: p.read_bytes() for p in before} == before


# ------------------------------------------------------------------------------------------------
# the GEMV kernel

SHAPES = [  # (N, K, T): odd N, K a multiple of 2 only, tails of every length, batch 1..16
    (1, 2, 1),
    (5, 30, 3),
    (7, 126, 1),
    (13, 130, 5),
    (3, 254, 16),
    (33, 1002, 2),
    (64, 2050, 7),
    (9, 7168, 1),
]


def _data(n, k, t, seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, generator=g) * 0.1 + 1e-3
    x = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 10
    return packed, scale, x


@pytest.mark.parametrize(("n", "k", "t"), SHAPES)
def test_kernel_isas_exact_and_identical(native_or_skip, monkeypatch, n, k, t):
    packed, scale, x = _data(n, k, t, seed=n * k + t)
    ref = gemv_ref(packed, scale, x)
    outs = {}
    for isa in G.isa_names():
        monkeypatch.setenv("HETQUANT_INT4_ISA", isa)
        y = G.int4_gemv(packed, scale, x, backend="native", threads=2)
        assert y.dtype == torch.float32 and y.shape == (t, n)
        assert_within(y, ref, gemv_bound(packed, scale, x, y, "native") / 2)
        outs[isa] = y
    # integer accumulation: every instruction path gives the same bits
    assert all(torch.equal(y, outs["generic"]) for y in outs.values())


@pytest.mark.parametrize(("n", "k", "t"), [*SHAPES, (6, 64, 17)])
def test_torch_backend_and_auto(n, k, t):
    packed, scale, x = _data(n, k, t, seed=7 * n + k)
    ref = gemv_ref(packed, scale, x)
    y = G.int4_gemv(packed, scale, x, backend="torch")
    assert_within(y, ref, gemv_bound(packed, scale, x, y, "torch") / 2)
    y = G.int4_gemv(packed, scale, x)  # auto: native up to 16 tokens, torch above
    either = torch.maximum(
        gemv_bound(packed, scale, x, y, "torch"), gemv_bound(packed, scale, x, y, "native")
    )
    assert_within(y, ref, either / 2)


def test_kernel_strided_rows_bf16_and_1d(native_or_skip):
    g = torch.Generator().manual_seed(8)
    down = torch.randint(0, 256, (3, 70, 48), dtype=torch.uint8, generator=g)  # [E, H, I/2]
    view = down[1, :, 16:40]  # a subpool's column slice: rows of 24 bytes, stride 48
    scale = torch.rand(70, generator=g)
    x = torch.randn(48, generator=g).to(torch.bfloat16)
    y = G.int4_gemv(view, scale, x, backend="native")
    assert y.shape == (70,)
    y2 = G.int4_gemv(view.contiguous(), scale, x.float(), backend="torch")
    ref = gemv_ref(view, scale, x.float())  # [70]
    assert_within(y, ref, gemv_bound(view, scale, x.float(), y, "native")[0] / 2)
    assert_within(y2, ref, gemv_bound(view, scale, x.float(), y2, "torch")[0] / 2)


@pytest.mark.parametrize("mag", [1e-42, 1e-30, 1.0, 1e20, 3e37])
def test_kernel_extreme_activation_scales(native_or_skip, mag):
    """Tiny (subnormal) and huge activations: the fixed-point exponent leaves float range."""
    packed, scale, x = _data(5, 66, 3, seed=12)
    x = (x / x.abs().amax() * mag).to(torch.float32)
    y = G.int4_gemv(packed, scale, x, backend="native")
    ref = gemv_ref(packed, scale, x)
    tiny = 2.0**-149 * scale.double() * 7 * 66  # subnormal x: its own spacing is the limit
    assert_within(y, ref, gemv_bound(packed, scale, x, y, "native") / 2 + tiny)


def test_kernel_zero_and_nonfinite_activations(native_or_skip):
    packed, scale, _ = _data(8, 64, 1, seed=9)
    assert torch.equal(
        G.int4_gemv(packed, scale, torch.zeros(2, 64), backend="native"), torch.zeros(2, 8)
    )
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    y = G.int4_gemv(packed, scale, x, backend="native")  # falls back to float math
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    x[1, 3] = float("inf")
    y = G.int4_gemv(packed, scale, x, backend="native")
    assert not torch.isfinite(y[1]).any() and torch.isfinite(y[0]).all()


def test_kernel_on_a_fresh_layer(native_or_skip):
    """quantize_expert → stack → GEMV of gate/up equals the float64 product (no artifact)."""
    g = torch.Generator().manual_seed(11)
    inter, hidden = 96, 130
    experts = [
        quantize_expert(
            torch.randn(inter, hidden, generator=g),
            torch.randn(inter, hidden, generator=g),
            torch.randn(hidden, inter, generator=g),
        )
        for _ in range(2)
    ]
    layer = stack_experts(experts)
    x = torch.randn(3, hidden, generator=g)
    xs = x[:, : inter // 3]
    for s in range(3):
        v = subpool_slice(layer, s, 3)
        packed, scale = v["down_packed"][1], v["down_scale"][1]  # strided rows
        y = G.int4_gemv(packed, scale, xs, backend="native")
        ref = gemv_ref(packed, scale, xs)
        assert_within(y, ref, gemv_bound(packed, scale, xs, y, "native") / 2)
