"""The native INT4 GEMV's persistent worker pool: any thread count gives the same bits, pools are
reused across calls, concurrent callers keep their own workers, and a forked child works; the
GEMM-shaped (token-blocked) order gives the same bits as the plain one on every path."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from hetquant.runtime.kernels import int4_gemv as G

N, K = 1030, 2048  # N not a multiple of the 4-row tile; N·K large enough for 5 threads


@pytest.fixture(autouse=True)
def _native() -> None:
    if not G.native_available():
        pytest.skip(f"native int4 kernel unavailable: {G.native_info()['error']}")


def _data(seed: int, t: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(N, generator=g) + 1e-3
    return packed, scale, torch.randn(t, K, generator=g)


@pytest.mark.parametrize("t", [1, 3])
def test_every_thread_count_gives_the_same_bits(t: int) -> None:
    packed, scale, x = _data(t, t)
    one = G.int4_gemv(packed, scale, x, backend="native", threads=1)
    for threads in (2, 3, 5, 2, 5, 1, 4):  # growing, shrinking and reusing the pool
        for _ in range(3):
            y = G.int4_gemv(packed, scale, x, backend="native", threads=threads)
            assert torch.equal(y, one), threads


def test_concurrent_callers_each_get_their_own_pool() -> None:
    cases = [_data(10 + i) for i in range(4)]
    want = [G.int4_gemv(*c, backend="native", threads=1) for c in cases]
    bad: list[int] = []

    def call(i: int) -> None:
        for _ in range(20):
            if not torch.equal(G.int4_gemv(*cases[i], backend="native", threads=3), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()  # a caller's pool is joined at its exit: no hang
    assert bad == []


def _child(q: mp.Queue) -> None:
    packed, scale, x = _data(99)
    q.put(G.int4_gemv(packed, scale, x, backend="native", threads=3).tolist())


def test_a_forked_child_after_pooled_calls() -> None:
    packed, scale, x = _data(99)
    want = G.int4_gemv(packed, scale, x, backend="native", threads=3)  # parent's pool exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert torch.equal(torch.tensor(got), want)


@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize("n, k, t", [(37, 7168, 17), (1030, 2048, 40), (5, 7168, 64)])
def test_token_blocking_gives_the_same_bits(
    monkeypatch, group: int, n: int, k: int, t: int
) -> None:
    g = torch.Generator().manual_seed(n + t)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, generator=g) + 1e-3
    if group:
        scale = (torch.rand(n, k // group, generator=g) + 1e-3).bfloat16()
    x = torch.randn(t, k, generator=g)
    for isa in G.isa_names():
        monkeypatch.setenv("HETQUANT_INT4_ISA", isa)
        if isa == "avx512_vnni" and G.native_info()["isa"] != isa:
            continue  # this CPU lacks it (the cross-ISA test runs it on SIMDe)
        plain = G.int4_gemv(packed, scale, x, backend="native", token_block=0, threads=1)
        for tb, threads in ((None, 1), (2, 1), (5, 3), (None, 2)):
            y = G.int4_gemv(packed, scale, x, backend="native", token_block=tb, threads=threads)
            assert torch.equal(y, plain), (isa, tb, threads)
        ref = G.int4_gemv_torch(packed, scale, x)
        assert (plain - ref).abs().max() <= 1e-4 * ref.abs().max()
