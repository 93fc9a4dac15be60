"""Reading byte spans of safetensors shards into tensors: the loader's I/O.

A rank's part of a stored tensor is a slice along one dim of a row-major view, i.e. a ``Span``:
``count`` runs of ``run`` bytes, ``stride`` apart. Contiguous spans (row splits, whole tensors)
are read with ``preadv`` straight into the destination buffers, the spans of adjacent tensors of
a file merged into one call; strided spans (column splits) are one strided copy out of the
file's private memory map, which faults in only the pages that hold wanted bytes. Targets:

- CPU, mapped (the default): a whole-range tensor whose file offset is 8-byte aligned is a view
  of the file's private (copy-on-write) memory map, its pages populated before ``load`` returns
  (``MADV_WILLNEED`` then ``MADV_POPULATE_READ``): the bytes are read once, into the page cache,
  and the tensor shares them instead of copying them into new anonymous memory. Writes to such a
  tensor stay private to the process. The file must not be truncated or rewritten in place while
  the tensors live (as with any memory-mapped loader); ``copy=True`` avoids that;
- CPU, copied: into each tensor's own buffer;
- CUDA: chunks of at most 16 MiB (or one strided run) dealt to up to 16 reader threads, each
  with two reused pinned staging buffers and asynchronous host-to-device copies on its own
  stream (``_staging``) — pageable ``.to(cuda)`` is 5-6x slower (reference/sharding_loading.md
  §2.1), and one reader thread is held to one core's memcpy speed;
- any other device: a CPU buffer per tensor, then ``.to(device)``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hetquant.formats.errors import HetquantError
from hetquant.formats.safe_paths import open_regular

from ..parallel.pieces import Span
from ._staging import STAGE_BYTES, CudaLane, lane_count, staged_copy

__all__ = ["LoadStats", "Span", "read_spans"]

_IOV = 512  # iovecs per preadv (Linux IOV_MAX is 1024)
_MAP_ALIGN = 8  # mapped views start at offsets aligned for every stored dtype
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_STAGE = STAGE_BYTES  # pinned staging chunk for CUDA loads


@dataclass
class LoadStats:
    """What one load did: tensor bytes read from files, tensors, read calls, strided copies."""

    bytes_read: int = 0
    tensors: int = 0
    syscalls: int = 0
    strided_copies: int = 0
    mapped: int = 0  # tensors that are views of a file's memory map (no copy)


def read_spans(
    root: Path,
    items: Sequence[tuple[str, str, Span]],
    target: torch.device,
    stats: LoadStats,
    *,
    copy: bool = False,
    opened: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """``(name, file relative to root, span)`` → {name: uint8 bytes on ``target``}.

    For CUDA the copies are asynchronous: synchronize before using the tensors. On the CPU,
    ``copy=False`` returns views of the files' memory maps where a span allows it. Every file
    is opened before any is read; ``opened`` is called then (the loader's check that they are
    all of one artifact, ``_pin``).
    """
    if target.type == "cuda" and not torch.cuda.is_available():
        raise HetquantError(f"device {target} requested but CUDA is not available here")
    by_file: dict[str, list[tuple[str, Span]]] = {}
    for name, file, span in items:
        by_file.setdefault(file, []).append((name, span))
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        sources = {f: stack.enter_context(_Source(root / f, stats)) for f in by_file}
        if opened is not None:
            opened()
        for file, spans in by_file.items():
            out.update(_read_file(sources[file], spans, target, copy))
    stats.tensors += len(out)
    return out


def _read_file(
    src: _Source, spans: list[tuple[str, Span]], target: torch.device, copy: bool
) -> dict[str, torch.Tensor]:
    if target.type == "cuda":
        return _to_cuda(src, spans, target)
    out = {}
    if target.type == "cpu" and not copy:
        out = src.mapped_views([(n, s) for n, s in spans if _mappable(s)])
        spans = [(n, s) for n, s in spans if n not in out]
    bufs = {name: torch.empty(s.nbytes, dtype=torch.uint8) for name, s in spans}
    src.read_many([(s, bufs[name]) for name, s in spans])
    for name, buf in bufs.items():
        out[name] = buf if target.type == "cpu" else buf.to(target)
    return out


def _mappable(span: Span) -> bool:
    return span.count == 1 and span.run > 0 and span.start % _MAP_ALIGN == 0


def _to_cuda(
    src: _Source, spans: list[tuple[str, Span]], target: torch.device
) -> dict[str, torch.Tensor]:
    size = max([_STAGE] + [s.run for _, s in spans if s.count > 1])  # a strided run is not cut
    out = {name: torch.empty(s.nbytes, dtype=torch.uint8, device=target) for name, s in spans}
    chunks = [
        (sub, out[name][offset : offset + sub.nbytes])
        for name, span in spans
        for sub, offset in _chunks(span, size)
    ]
    staged_copy(
        chunks,
        lambda sub, buf: src.read_many([(sub, buf)]),
        lambda: CudaLane(size, target),
        lane_count(len(chunks)),
    )
    return out


def _chunks(span: Span, limit: int) -> Iterator[tuple[Span, int]]:
    """``span`` cut into pieces of at most ``limit`` bytes: (piece, offset in the tensor)."""
    if span.count == 1:
        for off in range(0, span.run, limit):
            n = min(limit, span.run - off)
            yield Span(span.start + off, n, n), off
        return
    rows = max(1, limit // max(span.run, 1))
    for r in range(0, span.count, rows):
        m = min(rows, span.count - r)
        yield Span(span.start + r * span.stride, span.run, span.stride, m), r * span.run


class _Source:
    """One open shard: ``preadv`` for contiguous spans, its memory map for strided ones.
    ``read_many`` may run in several threads at once (CUDA staging lanes)."""

    def __init__(self, path: Path, stats: LoadStats) -> None:
        self.path, self.stats, self.fd, self.mm = path, stats, open_regular(path), None
        self.lock = threading.Lock()  # the lazy map and the counters

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.mm = None  # unmapped now, or, if mapped views hold it, when the last one is freed
        os.close(self.fd)

    def _map(self) -> mmap.mmap:
        with self.lock:
            if self.mm is None:
                self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)  # private: never written
            return self.mm

    def _count(self, **add: int) -> None:
        with self.lock:
            for key, n in add.items():
                setattr(self.stats, key, getattr(self.stats, key) + n)

    def mapped_views(self, spans: list[tuple[str, Span]]) -> dict[str, torch.Tensor]:
        """Views of the file's map for contiguous ``spans``, their pages read in before return."""
        if not spans:
            return {}
        mm, size = self._map(), os.fstat(self.fd).st_size
        out = {}
        for name, span in spans:
            if span.start + span.run > size:
                raise HetquantError(
                    f"{self.path}: ends before byte {span.start + span.run}; truncated"
                )
            out[name] = torch.frombuffer(mm, dtype=torch.uint8, count=span.run, offset=span.start)
        for lo, hi in _page_ranges(s for _, s in spans):
            self._populate(mm, lo, hi - lo)
        self._count(bytes_read=sum(s.run for _, s in spans), mapped=len(out))
        return out

    def _populate(self, mm: mmap.mmap, start: int, length: int) -> None:
        mm.madvise(mmap.MADV_WILLNEED, start, length)  # readahead of the whole range, async
        try:
            mm.madvise(_MADV_POPULATE_READ, start, length)
        except OSError:  # kernel < 5.14: touch one byte per page
            view = torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=start)
            view[::_PAGE].max()
            del view
        self._count(syscalls=2)

    def read_many(self, items: list[tuple[Span, torch.Tensor]]) -> None:
        """Fill each CPU uint8 buffer from its span; adjacent contiguous spans share a call."""
        batch: list[tuple[Span, torch.Tensor]] = []
        self._count(bytes_read=sum(span.nbytes for span, _ in items))
        for span, buf in sorted(items, key=lambda it: it[0].start):
            if span.nbytes == 0:
                continue
            if span.count > 1:
                self._strided(span, buf)
                continue
            if batch and (
                batch[-1][0].start + batch[-1][0].run != span.start or len(batch) >= _IOV
            ):
                self._preadv(batch)
                batch = []
            batch.append((span, buf))
        if batch:
            self._preadv(batch)

    def _preadv(self, batch: list[tuple[Span, torch.Tensor]]) -> None:
        views = [memoryview(buf.numpy()) for _, buf in batch]
        offset, left = batch[0][0].start, sum(s.run for s, _ in batch)
        while views:
            n = os.preadv(self.fd, views, offset)
            self._count(syscalls=1)
            if n <= 0:
                raise HetquantError(f"{self.path}: ends before byte {offset + left}; truncated")
            offset, left = offset + n, left - n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if views and n:
                views[0] = views[0][n:]

    def _strided(self, span: Span, buf: torch.Tensor) -> None:
        count = (span.count - 1) * span.stride + span.run
        src = torch.frombuffer(self._map(), dtype=torch.uint8, count=count, offset=span.start)
        buf.view(span.count, span.run).copy_(
            src.as_strided((span.count, span.run), (span.stride, 1))
        )
        self._count(strided_copies=1)


def _page_ranges(spans: Iterator[Span]) -> list[tuple[int, int]]:
    """Page-aligned ``[lo, hi)`` ranges covering ``spans``, overlapping ones merged."""
    ranges: list[tuple[int, int]] = []
    for s in sorted(spans, key=lambda s: s.start):
        lo, hi = s.start - s.start % _PAGE, s.start + s.run
        if ranges and lo <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], hi))
        else:
            ranges.append((lo, hi))
    return ranges
