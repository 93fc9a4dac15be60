"""Writing a job's bytes into the containers: through a shared memory map, or ``pwrite``.

Maps where the output lives in memory (tmpfs), ``pwrite`` where a disk takes it (``fs/mounts.py``
says which, and why); ``HETQUANT_WRITE=mmap|pwrite`` forces one (A/B runs).

Buffered writes to one file serialize on its inode lock (ext4, xfs, tmpfs: ``inode_lock`` around
every ``write``), so sixteen workers ``pwrite``-ing into one 5 GB shard move ~2.5 GB/s together,
no more than one (``benchmarks/probes/convert_scaling_parts.py`` on the 16-core host: 2.3-2.8
GB/s for 1-16 writers of one file, 37 GB/s for 16 writers of their own files). Stores into a
``MAP_SHARED`` mapping of the file take no such lock, so each worker maps the files it writes and
copies a piece in. First ``MADV_POPULATE_WRITE`` (Linux 5.14+) makes the pages of the piece
exist and writable in one call — cheaper than a page fault per 4 KiB, and where a store would
raise SIGBUS (the file system is full: tmpfs, or blocks ext4 could not reserve) it returns
EFAULT, reported as ENOSPC, the engine's disk-full error. Where the kernel cannot populate
(older kernels, other systems) the writer falls back to ``pwrite`` for good.

Where a kernel computes the stored bytes themselves (FP8 blocks dequantized to a BF16 target),
:meth:`PieceWriter.destination` lends it the mapped pages to compute into, and the write of that
array copies nothing: a ``bf16`` conversion writes twice its source, so that copy was its largest
one (benchmarks/notes/convert-scaling.md, seventh round).

Each map is marked ``MADV_SEQUENTIAL``, so that unmapping it does not mark its pages accessed
(``zap_pte_range`` has long skipped that for such maps; Linux 6.3 moved the test into
``vma_has_recency``): otherwise, as a worker exits, every page it wrote moves to the active LRU
list under the node's LRU lock, all workers at once — the largest system-time item of a ``bf16``
conversion at 16 workers on tmpfs (``perf`` on the 16-core host;
benchmarks/notes/convert-scaling.md, ninth round). The output is written once and not read back,
so that recency was never true; reclaim, which also ignores such maps' accessed bits, may take
the written pages first (tmpfs: to swap), which is the order a write-once output wants. The
hint's readahead part does nothing for writes into new pages.

Huge pages are the tmpfs's to give: one mounted ``huge=within_size`` (or ``always``) stores the
output in 2 MiB pages — one fault, insertion and zeroing call per 2 MiB, not 512. On the 16-core
host at 16 workers, a ``huge=always`` output took a ``bf16`` conversion's system time from 34-39 s
to 13 s (wall 1.2-1.3× down), and a ``huge=within_size`` one made every recipe's wall 1.08-1.40×
shorter (docs/cli.md says how to mount one). The maps do not ask for them
(``MADV_HUGEPAGE``, which ``huge=advise`` would honour): under the kernel's default THP
``defrag=madvise`` such maps' faults compact memory in the faulting thread, and on a fragmented
host that cost more than it saved (benchmarks/notes/convert-scaling.md, tenth round).

With ``hash_nodes`` (a pool worker whose output's digest is the BLAKE3 tree), every piece is
stored a slice at a time (``_SLICE``), through the map or with ``pwrite``, and each slice is
hashed right after, while it is still in the core's cache (``stored_nodes.py``);
:meth:`PieceWriter.take_nodes` hands the nodes over at the job's end, and the parent reads
nothing back (benchmarks/notes/convert-scaling.md, eighth round).
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from hetquant.formats.safetensors_io import byte_view, write_at

from ..fs.mounts import memory_backed
from ..fs.os_errors import naming
from ..planning.containers import Container
from .stored_nodes import Nodes, StoredNodes

__all__ = ["WRITE_ENV", "PieceWriter"]

WRITE_ENV = "HETQUANT_WRITE"

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PAGE = mmap.PAGESIZE
_SLICE = 1 << 20  # bytes stored then hashed at a time (``hash_nodes``): still in the L2


class PieceWriter:
    """Writes tensors' bytes into the containers under ``work_dir`` (one per process)."""

    def __init__(self, files: list[Container], work_dir: Path, mapped: bool = True, hash_nodes: bool = False) -> None:  # fmt: skip
        self.work_dir = work_dir
        # tensor → (its container, its offset there): ``hashing._where``'s shape
        self.where = {name: (f, off) for f in files for name, off in f.offsets().items()}
        self.sizes = {f.name: f.size for f in files}  # file → its size (a header each: once)
        self._paths = {f.name: work_dir / f.name for f in files}  # (a Path per write: measurable)
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._addr: dict[str, int] = {}  # file → its mapping's address (``destination``)
        forced = os.environ.get(WRITE_ENV, "").lower()  # "mmap" / "pwrite": A/B runs
        memory = forced == "mmap" or (forced != "pwrite" and memory_backed(work_dir))
        self.mapped = mapped and hasattr(mmap.mmap, "madvise") and memory
        self._hashed = StoredNodes(self.sizes) if hash_nodes else None

    def write(self, tensor: str, offset: int, data: Any) -> None:
        """Write ``data`` (bytes, a numpy array or a CPU tensor: ``safetensors_io.byte_view``)
        at ``offset`` bytes past the start of output tensor ``tensor``; nothing where ``data``
        is the :meth:`destination` of those bytes."""
        container, start = self.where[tensor]
        file = container.name
        pos = start + offset
        if isinstance(data, np.ndarray) and data.size and file in self._addr:
            if data.ctypes.data == self._addr[file] + pos and data.flags.c_contiguous:  # in place
                if self._hashed is not None:
                    self._hashed.stored(file, pos, data.reshape(-1).view(np.uint8))
                return
        with naming(self._paths[file]):  # ENOMEM (mmap), EFBIG (ulimit -f), EMFILE: no path
            fd = self._fd(file)
            src = byte_view(data)
            mapped = self.mapped and src.nbytes and self._populate(file, fd, pos, src.nbytes)
            step = _SLICE if self._hashed is not None else max(src.nbytes, 1)
            for at in range(0, src.nbytes, step):
                part = src[at : at + step]
                if mapped:  # one memcpy; no export outlives it
                    self._maps[file][pos + at : pos + at + part.nbytes] = part
                else:
                    write_at(fd, pos + at, part)
                if self._hashed is not None:
                    self._hashed.stored(file, pos + at, np.frombuffer(part, np.uint8))

    def take_nodes(self) -> tuple[list[tuple[str, Nodes]], int] | None:
        """((file, tree nodes) hashed since the last call, the bytes stored since) with
        ``hash_nodes``, for one job (``stored_nodes.StoredNodes.take``); else None."""
        return None if self._hashed is None else self._hashed.take()

    def destination(self, tensor: str, offset: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:  # fmt: skip
        """The output bytes of ``tensor`` from ``offset`` on as a writable C-contiguous array
        of ``shape`` and ``dtype`` over the file's mapping, its pages made to exist (as
        :meth:`write` does), for a kernel to compute into; None where the writer does not map.
        The array must not be used after :meth:`close` (it holds no reference to the map)."""
        if not self.mapped:
            return None
        container, start = self.where[tensor]
        file = container.name
        pos = start + offset
        n = math.prod(shape) * np.dtype(dtype).itemsize
        with naming(self._paths[file]):
            if not n or not self._populate(file, self._fd(file), pos, n):
                return None
        at = self._addr[file] + pos  # populated, so mapped
        raw = (ctypes.c_char * n).from_address(at)  # no export of the map
        return np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self._paths[file], os.O_RDWR)
        return fd

    def _populate(self, file: str, fd: int, pos: int, n: int) -> bool:
        """Map ``file`` (once) and make its pages ``pos .. pos + n`` exist and writable; False
        where this kernel cannot populate (the writer then ``pwrite``s for good)."""
        m = self._maps.get(file)
        if m is None:
            m = self._maps[file] = mmap.mmap(fd, self.sizes[file], mmap.MAP_SHARED)
            held = ctypes.c_char.from_buffer(m)  # an export while the address is read
            self._addr[file] = ctypes.addressof(held)
            del held
            m.madvise(mmap.MADV_SEQUENTIAL)  # no LRU activation of its pages at unmap
        first = pos // _PAGE * _PAGE
        try:
            m.madvise(_MADV_POPULATE_WRITE, first, pos + n - first)
        except OSError as e:
            if e.errno == errno.EFAULT:  # a store would raise SIGBUS: no space for the pages
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._paths[file])) from None  # fmt: skip
            self.mapped = False  # EINVAL: this kernel cannot populate; pwrite from now on
            return False
        return True

    def close(self) -> None:
        self.take_nodes()
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        self._addr.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
