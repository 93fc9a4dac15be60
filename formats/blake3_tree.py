"""BLAKE3 of one input hashed in pieces, in any order, then merged: the standard digest.

BLAKE3 (the specification, blake3.pdf 2.1-2.6) splits its input into 1024-byte chunks, hashes
each with its index as counter, and merges them in a left-balanced binary tree: for ``n`` chunks
the left subtree holds the largest power of two of them below ``n``, recursively. So every
aligned run ``[i·2^k, (i+1)·2^k)`` of chunks lying inside ``[0, n)`` and shorter than ``n`` is a
node of that tree (the last chunk may be short: it ends the input), and its chaining value
depends on those bytes and its place only. :class:`TreeDigest` collects such chaining values as
byte ranges of a file become final (:meth:`TreeDigest.add`, from any thread: the C++ work
releases the GIL) and :meth:`TreeDigest.hexdigest` merges them, hashing what no range covered
(the chunks that straddle two ranges; bytes never written) from the file — the same hex string
as ``blake3(file bytes).hexdigest()`` (tests/formats/test_blake3_tree.py, against the
``blake3`` package, on every instruction path).

The C++ (``_blake3_native.cpp`` then ``_blake3_tree.cpp``, compiled on first use by ``native.NativeLibrary``) compresses
4, 8 or 16 chunks at once (generic, AVX2, AVX-512). Without a compiler, or with
``HETQUANT_TREE_HASH=0``, :func:`available` is False and callers hash front to back with the
``blake3`` package instead.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np

from .native import DEFAULT_FLAGS, NativeLibrary

__all__ = [
    "CHUNK",
    "LANES",
    "MAX_SUBTREE",
    "TreeDigest",
    "available",
    "compact_nodes",
    "covered_bytes",
    "lanes",
    "range_nodes",
]

CHUNK = 1024
MAX_SUBTREE = 1 << 12  # chunks per node hashed at once: 4 MiB read (as in the C++)
LANES = (4, 8, 16)  # the instruction paths, by chunks compressed at once


def _bind(lib: ctypes.CDLL) -> None:
    vp, ci, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
    lib.hq_b3_lanes.argtypes, lib.hq_b3_lanes.restype = [], ci
    lib.hq_b3_subtree.argtypes, lib.hq_b3_subtree.restype = [vp, i64, u64, vp, ci], ci
    lib.hq_b3_parent.argtypes, lib.hq_b3_parent.restype = [vp, vp, ci, vp], None
    lib.hq_b3_single.argtypes, lib.hq_b3_single.restype = [vp, i64, vp], ci
    lib.hq_b3_range.argtypes = [ci, vp, i64, i64, i64, i64, vp, vp, vp, i64, ci]
    lib.hq_b3_range.restype = i64
    lib.hq_b3_compact.argtypes, lib.hq_b3_compact.restype = [vp, vp, vp, i64, i64], i64
    lib.hq_b3_root.argtypes = [ci, vp, i64, vp, vp, vp, i64, vp, ci]
    lib.hq_b3_root.restype = ci


_LIBRARY = NativeLibrary(
    "blake3_tree",
    "".join(
        (Path(__file__).parent / n).read_text(encoding="utf-8")
        for n in ("_blake3_native.cpp", "_blake3_tree.cpp")
    ),
    _bind,
    flags=DEFAULT_FLAGS,
    label="BLAKE3 subtree hashing",
    fallback="the blake3 package, front to back",
)


def available() -> bool:
    """Whether the subtree hasher is built and enabled (builds it on first call)."""
    return os.environ.get("HETQUANT_TREE_HASH", "1") != "0" and _LIBRARY.get().lib is not None


def lanes() -> int:
    """Chunks this CPU's path compresses at once (a value of ``LANES``)."""
    lib = _LIBRARY.get().lib
    return int(lib.hq_b3_lanes()) if lib is not None else 0


def _range(fd: int, mem: int | None, at: int, size: int, start: int, end: int, lanes: int) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
    cap = (end - start) // (MAX_SUBTREE * CHUNK) + 2 * MAX_SUBTREE.bit_length() + 4
    first, k = np.empty(cap, np.int64), np.empty(cap, np.int64)
    cv = np.empty((cap, 32), np.uint8)
    args = (first.ctypes.data, k.ctypes.data, cv.ctypes.data, cap, lanes)
    n = _LIBRARY.get().lib.hq_b3_range(fd, mem, at, size, start, end, *args)
    return n, (first[: max(n, 0)], k[: max(n, 0)], cv[: max(n, 0)])


def covered_bytes(size: int, first: np.ndarray, k: np.ndarray) -> int:
    """Bytes of an input of ``size`` bytes that the nodes ``(first chunk, chunks)`` cover."""
    return int(np.minimum((first + k) * CHUNK, size).sum() - (first * CHUNK).sum())


def compact_nodes(size: int, first: np.ndarray, k: np.ndarray, cv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Nodes ``(first chunk, chunks, chaining value)`` of an input of ``size`` bytes, sorted by
    first chunk and disjoint, with every two that are the halves of a larger node (not the
    root) merged into it: the fewest nodes over the same chunks, the same digest. A writer's
    many small runs of nodes (one per slice it stored) become few."""
    first, k = np.array(first, np.int64), np.array(k, np.int64)  # copies: merged in place
    cv = np.array(cv, np.uint8).reshape(-1, 32)
    if len(first) < 2:
        return first, k, cv
    n = _LIBRARY.get().lib.hq_b3_compact(first.ctypes.data, k.ctypes.data, cv.ctypes.data, len(first), size)  # fmt: skip
    return first[:n], k[:n], cv[:n]


def range_nodes(size: int, buf: np.ndarray, at: int, start: int, end: int, lanes: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """:meth:`TreeDigest.nodes` of bytes ``[start, end)`` of an input of ``size`` bytes, taken
    from ``buf`` (uint8, C-contiguous), which holds bytes ``[at, at + len(buf))`` of it:
    what a writer has in hand before (or after) it stores them."""
    if not (at <= start <= end <= at + buf.size and buf.flags.c_contiguous and buf.itemsize == 1):
        raise ValueError(f"range_nodes: [{start}, {end}) not inside the buffer's [{at}, {at + buf.size})")  # fmt: skip
    n, out = _range(-1, buf.ctypes.data, at, size, start, end, lanes)
    if n < 0:  # -2: more nodes than _range's cap; -1 (a read) cannot happen from memory
        why = "node list overflow" if n == -2 else f"error {n}"
        raise ValueError(f"blake3 {why} in bytes [{start}, {end}) of {size} (buffer at {at})")
    return out


class TreeDigest:
    """The BLAKE3 digest of one input of ``size`` bytes, from pieces (module docstring): its
    bytes in memory (``data``, uint8) or in the open file ``fd`` (read 4 MiB at a time into a
    buffer per thread: no map, whose teardown after tens of GB read through it was seconds of
    serial time on the 16-core host). Each :meth:`add` is one C++ call that releases the GIL.
    """

    def __init__(self, size: int, *, data: np.ndarray | None = None, fd: int = -1,
                 path: str = "", lanes: int = 0) -> None:  # fmt: skip
        if (data is None) == (fd < 0):
            raise ValueError("TreeDigest: give data or fd")
        self.size, self._data, self._fd, self._path, self._lanes = size, data, fd, path, lanes
        self._mem = None if data is None else data.ctypes.data
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()
        self.hashed = 0  # bytes covered by known nodes

    def add(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` are final: hash the tree nodes inside them."""
        self.add_nodes(*self.nodes(start, end))

    def add_nodes(self, first: np.ndarray, k: np.ndarray, cv: np.ndarray) -> None:
        """Take nodes :meth:`nodes` gave, here or in another process over the same bytes."""
        nbytes = covered_bytes(self.size, first, k)
        with self._lock:
            self._parts.append((first, k, cv))
            self.hashed += nbytes

    def nodes(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first chunk, chunks, chaining value)`` of the tree nodes wholly inside bytes
        ``[start, end)``, largest first, at most ``MAX_SUBTREE`` chunks each, never the root."""
        n, out = _range(self._fd, self._mem, 0, self.size, start, end, self._lanes)
        self._check(n, start)
        return out

    def hexdigest(self) -> str:
        with self._lock:
            parts = list(self._parts)
        first = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
        order = np.argsort(first, kind="stable")
        first = np.ascontiguousarray(first[order])
        k = np.ascontiguousarray(np.concatenate([p[1] for p in parts])[order]) if parts else first
        cv = np.ascontiguousarray(np.concatenate([p[2] for p in parts])[order]) if parts else first
        out = ctypes.create_string_buffer(32)
        rc = _LIBRARY.get().lib.hq_b3_root(
            self._fd, self._mem, self.size, first.ctypes.data, k.ctypes.data, cv.ctypes.data,
            len(first), out, self._lanes,
        )  # fmt: skip
        self._check(rc, 0)
        return out.raw.hex()

    def _check(self, rc: int, at: int) -> None:
        if rc == -1:
            raise OSError(f"{self._path}: read failed or unexpected end of file "
                          f"(hashing from byte {at} of {self.size})")  # fmt: skip
        if rc < -1:
            raise ValueError(f"{self._path}: blake3 node list overflow at byte {at}")
