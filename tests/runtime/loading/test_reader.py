"""The loader's I/O (runtime/loading/_reader.py): CPU loads as views of the files' private memory maps,
against copies of the same bytes."""

from __future__ import annotations

import gc
import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from support import TINY, run_cli

from hetquant.formats import HetquantError
from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.loading._reader import (
    LoadStats,
    Span,
    _chunks,
    _page_ranges,
    _Source,
    read_spans,
)
from hetquant.runtime.loading._staging import MAX_LANES, lane_count, staged_copy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src = tmp_path_factory.mktemp("src") / "tiny"
    shutil.copytree(TINY, src)
    out = {}
    for recipe, opts in (("bf16", ()), ("ascend-w8a8", ("--mtp", "drop"))):
        dst = tmp_path_factory.mktemp(recipe) / "art"
        res = run_cli("convert", src, dst, "--recipe", recipe, *opts)
        assert res.exit_code == 0, res.stderr
        out[recipe] = dst
    return out


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("recipe", ["bf16", "ascend-w8a8"])
@pytest.mark.parametrize("tp", [(1, 0), (2, 1)])
def test_mapped_load_equals_copied_load(arts, recipe: str, tp: tuple[int, int]) -> None:
    lay = ParallelLayout(tp_size=tp[0], tp_rank=tp[1])
    art = open_artifact(arts[recipe])
    mapped = art.load(lay)
    m_stats = art.last_load
    copied = art.load(lay, copy=True)
    c_stats = art.last_load
    assert mapped.keys() == copied.keys()
    assert all(_same(mapped[k], copied[k]) for k in mapped)
    assert m_stats.bytes_read == c_stats.bytes_read
    assert c_stats.mapped == 0
    assert m_stats.mapped > 0.5 * m_stats.tensors  # most tensors are whole aligned ranges
    if tp[0] > 1:
        assert m_stats.strided_copies == c_stats.strided_copies > 0  # column splits still copy


def test_mapped_tensors_are_private_and_outlive_the_artifact(arts) -> None:
    root = arts["bf16"]
    before = _digest(root)
    art = open_artifact(root)
    ref = {k: v.clone() for k, v in art.load(ParallelLayout(), copy=True).items()}
    tensors = art.load(ParallelLayout())
    del art
    gc.collect()
    for t in tensors.values():  # copy-on-write: the file and other loads never see this
        t.view(torch.uint8).fill_(0x55)
    assert _digest(root) == before
    again = open_artifact(root).load(ParallelLayout())
    assert all(_same(again[k], ref[k]) for k in ref)
    del tensors
    gc.collect()  # unmaps; the other load's views stay valid
    assert all(_same(again[k], ref[k]) for k in ref)


def test_unaligned_span_is_copied_and_aligned_one_mapped(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4
    (tmp_path / "f.bin").write_bytes(data)
    stats = LoadStats()
    items = [("odd", "f.bin", Span(3, 20, 20)), ("even", "f.bin", Span(64, 600, 600))]
    out = read_spans(tmp_path, items, CPU, stats)
    assert bytes(out["odd"].numpy()) == data[3:23]
    assert bytes(out["even"].numpy()) == data[64:664]
    assert stats.mapped == 1 and stats.bytes_read == 620


def test_mapped_span_past_the_end_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"\0" * 100)
    with pytest.raises(HetquantError, match="truncated"):
        read_spans(tmp_path, [("t", "f.bin", Span(8, 200, 200))], CPU, LoadStats())


def test_page_ranges_merge_and_align() -> None:
    p = 4096
    spans = [Span(10, 5, 5), Span(p + 1, 10, 10), Span(3 * p + 7, p, p), Span(20, 100, 100)]
    assert _page_ranges(iter(spans)) == [(0, 120), (p, p + 11), (3 * p, 4 * p + 7)]


class _CpuLane:
    """A CPU stand-in for CudaLane: two buffers, synchronous sends, and a record of its use."""

    def __init__(self, size: int, log: list[int]) -> None:
        self.bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        self.i, self.log = 1, log

    def next(self) -> torch.Tensor:
        self.i ^= 1
        return self.bufs[self.i]

    def send(self, buf: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(buf)
        self.log.append(id(self))

    def finish(self) -> None:
        pass


@pytest.mark.parametrize("lanes", [1, 3])
def test_staged_copy_through_lanes_fills_every_destination(tmp_path: Path, lanes: int) -> None:
    data = torch.randint(
        0, 256, (50_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    (tmp_path / "f.bin").write_bytes(bytes(data.numpy()))
    spans = {
        "a": Span(0, 12_345, 12_345),
        "b": Span(20_000, 700, 1000, 29),
        "c": Span(49_000, 1000, 1000),
    }
    stats, log = LoadStats(), []
    with _Source(tmp_path / "f.bin", stats) as src:
        out = {n: torch.empty(s.nbytes, dtype=torch.uint8) for n, s in spans.items()}
        chunks = [
            (sub, out[n][off : off + sub.nbytes])
            for n, s in spans.items()
            for sub, off in _chunks(s, 1024)
        ]
        staged_copy(
            chunks, lambda sub, buf: src.read_many([(sub, buf)]), lambda: _CpuLane(1024, log), lanes
        )
    assert torch.equal(out["a"], data[:12_345])
    assert torch.equal(out["b"], data[20_000:49_000].view(29, 1000)[:, :700].reshape(-1))
    assert torch.equal(out["c"], data[49_000:50_000])
    assert len(log) == len(chunks) and len(set(log)) == lanes
    assert stats.bytes_read == sum(s.nbytes for s in spans.values())


def test_staged_copy_reraises_a_reader_error(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"\1" * 3000)
    dst = torch.empty(4000, dtype=torch.uint8)
    chunks = [(Span(i, 1000, 1000), dst[i : i + 1000]) for i in range(0, 4000, 1000)]
    with (
        _Source(tmp_path / "f.bin", LoadStats()) as src,
        pytest.raises(HetquantError, match="truncated"),
    ):
        staged_copy(
            chunks, lambda sub, buf: src.read_many([(sub, buf)]), lambda: _CpuLane(1000, []), 2
        )


def test_lane_count_bounds() -> None:
    assert lane_count(1) == 1
    assert 1 <= lane_count(1000) <= MAX_LANES
