"""``int4_moe``: the whole routed-expert sum in one native call equals, bit for bit, the
per-expert loop it replaces (two ``int4_gemv`` calls, ``F.silu``, ``index_add_``) — on every
instruction path of this CPU, both precisions, any thread count, strided subpool views, few and
many tokens per expert; and it declines (None) exactly the calls that loop must take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.int4_cpu import subpool_slice
from hetquant.runtime.kernels import int4_gemv as G
from hetquant.runtime.kernels.int4_moe import int4_moe

E, H, INTER = 7, 320, 96  # H/2 not a multiple of 64 (a partial chunk); 2·INTER rows not of 16


@pytest.fixture(autouse=True)
def _native() -> None:
    if not G.native_available():
        pytest.skip(f"native int4 kernel unavailable: {G.native_info()['error']}")


def _layer(seed: int, h: int = H, inter: int = INTER) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up_packed": torch.randint(0, 256, (E, 2 * inter, h // 2), dtype=torch.uint8, generator=g),
        "gate_up_scale": torch.rand(E, 2 * inter, generator=g) * 0.02 + 1e-3,
        "down_packed": torch.randint(0, 256, (E, h, inter // 2), dtype=torch.uint8, generator=g),
        "down_scale": torch.rand(E, h, generator=g) * 0.02 + 1e-3,
    }  # fmt: skip


def _routing(t: int, k: int, seed: int, hot: int | None = None):
    """(experts, offsets, tokens, weights) of t tokens' top-k, grouped by expert; ``hot``: every
    token also picks that expert (many tokens on one expert)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])  # [t, k]
    if hot is not None:
        ids[:, 0] = hot
        ids[:, 1:] = torch.where(ids[:, 1:] == hot, (hot + 1) % E, ids[:, 1:])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    weights = torch.rand(t * k, generator=g)[order]
    return experts, offsets, order // k, weights


def _loop(layer, x, experts, offsets, tokens, weights, **kw) -> torch.Tensor:
    """The per-expert loop of the CPU expert pool (``_Subpool.partial``)."""
    out = torch.zeros_like(x)
    for gi, e in enumerate(experts.tolist()):
        a, b = int(offsets[gi]), int(offsets[gi + 1])
        tok, w = tokens[a:b], weights[a:b]
        gu = G.int4_gemv(layer["gate_up_packed"][e], layer["gate_up_scale"][e], x[tok], **kw)
        act = F.silu(gu[:, 0::2]) * gu[:, 1::2]
        y = G.int4_gemv(layer["down_packed"][e], layer["down_scale"][e], act, **kw)
        out.index_add_(0, tok, y * w[:, None])
    return out


def _paths() -> list[str]:
    best = G.native_info()["isa"]
    names = G.isa_names()
    return list(names[: names.index(best) + 1])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("isa", _paths())
@pytest.mark.parametrize(
    ("t", "k", "hot", "precision"),
    [(1, 4, None, "high"), (5, 3, None, "fast"), (9, 2, 3, "high"), (40, 3, 1, "high")],
)
def test_bit_identical_to_the_per_expert_loop(monkeypatch, isa, t, k, hot, precision) -> None:
    monkeypatch.setenv("HETQUANT_INT4_ISA", isa)
    layer = _layer(t)
    x = torch.randn(t, H) * torch.rand(t, 1) * 4
    r = _routing(t, k, seed=t, hot=hot)
    want = _loop(layer, x, *r, backend="native", threads=1, precision=precision)
    for threads in (1, 2, 3):
        got = int4_moe(layer, x, *r, backend="native", threads=threads, precision=precision)
        assert got is not None and _same(got, want), (isa, threads)


@pytest.mark.parametrize(("subpools", "s"), [(2, 1), (3, 2)])
def test_strided_subpool_views(subpools, s) -> None:
    layer = _layer(11)
    view = subpool_slice(layer, s, subpools)  # strided down rows, offset gate_up rows
    x = torch.randn(6, H)
    r = _routing(6, 3, seed=5)
    want = _loop(view, x, *r, backend="native", threads=1)
    got = int4_moe(view, x, *r, backend="native", threads=2)
    assert got is not None and _same(got, want)


def test_entries_add_in_their_order_and_tokens_without_experts_are_zero() -> None:
    layer = _layer(3)
    x = torch.randn(4, H)
    # token 0 twice through expert 2 and once through 5 (weights apart); tokens 1, 3 unrouted
    experts, offsets = torch.tensor([2, 5]), torch.tensor([0, 2, 4])
    tokens, weights = torch.tensor([0, 2, 0, 2]), torch.tensor([0.5, 1e-3, 3.0, -2.0])
    want = _loop(layer, x, experts, offsets, tokens, weights, backend="native", threads=1)
    got = int4_moe(layer, x, experts, offsets, tokens, weights, threads=2)
    assert got is not None and _same(got, want)
    assert torch.equal(got[1], torch.zeros(H)) and torch.equal(got[3], torch.zeros(H))
    none = torch.zeros(0, dtype=torch.int64)
    empty = int4_moe(layer, x, none, torch.zeros(1, dtype=torch.int64), none, torch.zeros(0))
    assert empty is not None and torch.equal(empty, torch.zeros(4, H))


def test_declines_what_the_loop_must_do() -> None:
    layer = _layer(4)
    x = torch.randn(3, H)
    r = _routing(3, 2, seed=1)
    assert int4_moe(layer, x, *r, backend="torch") is None
    nan = x.clone()
    nan[1, 7] = float("nan")
    assert int4_moe(layer, nan, *r) is None  # the loop hands it to the torch path
    huge = dict(layer, gate_up_scale=layer["gate_up_scale"] * 1e36)  # activations overflow
    assert int4_moe(huge, x * 1e3, *r) is None
    grouped = dict(layer, gate_up_scale=torch.ones(E, 2 * INTER, H // 32, dtype=torch.bfloat16))
    assert int4_moe(grouped, x, *r) is None
    many = G.MAX_NATIVE_TOKENS + 1
    xm = torch.randn(many, H)
    rm = (torch.tensor([0]), torch.tensor([0, many]), torch.arange(many), torch.ones(many))
    assert int4_moe(layer, xm, *rm) is None  # backend "auto": the torch path's share
    got = int4_moe(layer, xm, *rm, backend="native", threads=2)
    assert got is not None and _same(got, _loop(layer, xm, *rm, backend="native", threads=1))


def test_bad_input() -> None:
    layer = _layer(5)
    x = torch.randn(2, H)
    r = _routing(2, 2, seed=2)
    with pytest.raises(HetquantError, match="x must be contiguous float32"):
        int4_moe(layer, x.double(), *r)
    with pytest.raises(HetquantError, match="disagree"):
        int4_moe(dict(layer, down_scale=layer["down_scale"][:, :-1]), x, *r)
    with pytest.raises(HetquantError, match="offsets"):
        int4_moe(layer, x, r[0], r[1][:-1], r[2], r[3])
    with pytest.raises(HetquantError, match="contiguous rows"):
        int4_moe(dict(layer, down_scale=layer["down_scale"].double()), x, *r)
    bad = (r[0] + E, *r[1:])  # an expert index past the layer
    with pytest.raises(HetquantError, match="code -1"):
        int4_moe(layer, x, *bad)
