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

The C++ (``_blake3_native.cpp``, compiled on first use by ``native.NativeLibrary``) compresses
4, 8 or 16 chunks at once (generic, AVX2, AVX-512). Without a compiler, or with
``HETQUANT_TREE_HASH=0``, :func:`available` is False and callers hash front to back with the
``blake3`` package instead.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
from pathlib import Path

import numpy as np

from .native import DEFAULT_FLAGS, NativeLibrary

__all__ = [
    "CHUNK",
    "LANES",
    "ArrayBytes",
    "FileBytes",
    "TreeDigest",
    "available",
    "lanes",
    "subtrees",
]

CHUNK = 1024
MAX_SUBTREE = 1 << 12  # chunks per chaining value computed in one call: 4 MiB read at once
LANES = (4, 8, 16)  # the instruction paths, by chunks compressed at once


def _bind(lib: ctypes.CDLL) -> None:
    vp, ci, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
    lib.hq_b3_lanes.argtypes, lib.hq_b3_lanes.restype = [], ci
    lib.hq_b3_subtree.argtypes, lib.hq_b3_subtree.restype = [vp, i64, u64, vp, ci], ci
    lib.hq_b3_parent.argtypes, lib.hq_b3_parent.restype = [vp, vp, ci, vp], None
    lib.hq_b3_single.argtypes, lib.hq_b3_single.restype = [vp, i64, vp], ci


_LIBRARY = NativeLibrary(
    "blake3_tree",
    (Path(__file__).parent / "_blake3_native.cpp").read_text(encoding="utf-8"),
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


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def subtrees(start: int, end: int, size: int, cap: int = MAX_SUBTREE) -> list[tuple[int, int]]:
    """``(first chunk, chunks)`` of the tree nodes wholly inside bytes ``[start, end)`` of a
    ``size``-byte input, greedily largest first (at most ``cap`` chunks each); the root is never
    one of them."""
    n = max(1, -(-size // CHUNK))
    first = -(-start // CHUNK)
    stop = n if end >= size else end // CHUNK
    out = []
    while first < stop:
        k = min(first & -first if first else 1 << 62, _pow2_floor(stop - first), cap)
        if k >= n:  # the whole input: the root, whose value needs the ROOT flag
            k = _pow2_floor(n - 1)
        out.append((first, k))
        first += k
    return out


class ArrayBytes:
    """The input in memory: ``view(offset, n)`` is a slice of ``data`` (uint8)."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self._data[offset : offset + nbytes]


class FileBytes:
    """The input in an open file: ``view(offset, n)`` reads (``preadv``) into a buffer of the
    calling thread, reused by its next call. Not a map of the file: unmapping a map of tens of
    GB that was read through tears down millions of page-table entries, serially (seconds at
    the end of a conversion, measured on the 16-core host)."""

    def __init__(self, fd: int, path: str = "") -> None:
        self._fd, self._path, self._local = fd, path, threading.local()

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = np.empty(max(nbytes, MAX_SUBTREE * CHUNK), np.uint8)
        mv, done = memoryview(buf), 0
        while done < nbytes:
            n = os.preadv(self._fd, [mv[done:nbytes]], offset + done)
            if n <= 0:
                raise OSError(f"{self._path}: unexpected end of file at byte {offset + done}")
            done += n
        return buf[:nbytes]


class TreeDigest:
    """The BLAKE3 digest of one input of ``size`` bytes, from pieces (module docstring).
    ``source``: its bytes (:class:`ArrayBytes` or :class:`FileBytes`), read by :meth:`add` for
    the ranges it is told of and by :meth:`hexdigest` for the gaps."""

    def __init__(self, size: int, source: ArrayBytes | FileBytes, lanes: int = 0) -> None:
        self.size, self._source, self._lanes = size, source, lanes
        self._n = max(1, -(-size // CHUNK))
        self._nodes: dict[tuple[int, int], bytes] = {}
        self._firsts: list[int] = []  # sorted first chunks of the known nodes
        self._lock = threading.Lock()
        self.hashed = 0  # bytes covered by known nodes

    def add(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of the file are final: hash the tree nodes inside them."""
        if self._n == 1:
            return  # a one-chunk file is hashed whole by hexdigest
        for first, k in subtrees(start, end, self.size):
            cv = self._subtree(first, k)
            with self._lock:
                self._nodes[(first, k)] = cv
                bisect.insort(self._firsts, first)
                self.hashed += self._nbytes(first, k)

    def hexdigest(self) -> str:
        lib = _LIBRARY.get().lib
        out = ctypes.create_string_buffer(32)
        if self._n == 1:
            data = self._source.view(0, self.size)
            if lib.hq_b3_single(data.ctypes.data, self.size, out) != 0:
                raise ValueError("blake3: a one-chunk input longer than a chunk")
            return out.raw.hex()
        return self._node(0, self._n, root=True).hex()

    def _node(self, first: int, k: int, root: bool = False) -> bytes:
        known = self._nodes.get((first, k))
        if known is not None and not root:
            return known
        whole = not root and k & (k - 1) == 0 and k <= MAX_SUBTREE
        if whole and (k == 1 or not self._inside(first, k)):
            return self._subtree(first, k)
        left = _pow2_floor(k - 1)  # the largest power of two below k
        lcv, rcv = self._node(first, left), self._node(first + left, k - left)
        out = ctypes.create_string_buffer(32)
        _LIBRARY.get().lib.hq_b3_parent(lcv, rcv, int(root), out)
        return out.raw

    def _inside(self, first: int, k: int) -> bool:
        """Whether a known node starts inside chunks ``[first, first + k)``."""
        i = bisect.bisect_left(self._firsts, first)
        return i < len(self._firsts) and self._firsts[i] < first + k

    def _subtree(self, first: int, k: int) -> bytes:
        out = ctypes.create_string_buffer(32)
        nbytes = self._nbytes(first, k)
        data = self._source.view(first * CHUNK, nbytes)
        rc = _LIBRARY.get().lib.hq_b3_subtree(data.ctypes.data, nbytes, first, out, self._lanes)
        if rc != 0:
            raise ValueError(f"blake3: chunks [{first}, {first + k}) are not a subtree")
        return out.raw

    def _nbytes(self, first: int, k: int) -> int:
        return min((first + k) * CHUNK, self.size) - first * CHUNK
