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

__all__ = ["CHUNK", "LANES", "TreeDigest", "available", "lanes", "subtrees"]

CHUNK = 1024
MAX_SUBTREE = 1 << 14  # chunks per chaining value computed in one call (16 MiB)
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


class TreeDigest:
    """The BLAKE3 digest of one file of ``size`` bytes, from pieces (module docstring).
    ``view``: the file's bytes as a uint8 array (a read-only map), used by :meth:`add` for
    the ranges it is told of and by :meth:`hexdigest` for the gaps."""

    def __init__(self, size: int, view: np.ndarray, lanes: int = 0) -> None:
        self.size, self._view, self._lanes = size, view, lanes
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
            if lib.hq_b3_single(self._addr(0), self.size, out) != 0:
                raise ValueError("blake3: a one-chunk input longer than a chunk")
            return out.raw.hex()
        return self._node(0, self._n, root=True).hex()

    def _node(self, first: int, k: int, root: bool = False) -> bytes:
        known = self._nodes.get((first, k))
        if known is not None and not root:
            return known
        whole = not root and k & (k - 1) == 0
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
        rc = _LIBRARY.get().lib.hq_b3_subtree(
            self._addr(first * CHUNK), nbytes, first, out, self._lanes
        )
        if rc != 0:
            raise ValueError(f"blake3: chunks [{first}, {first + k}) are not a subtree")
        return out.raw

    def _nbytes(self, first: int, k: int) -> int:
        return min((first + k) * CHUNK, self.size) - first * CHUNK

    def _addr(self, offset: int) -> int:
        return self._view.ctypes.data + offset
