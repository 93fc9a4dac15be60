"""The BLAKE3 tree nodes of what one writer stores, hashed as it stores them (``writer.py``).

A pool worker whose output's digest is the BLAKE3 tree (``tree_hashing.py``) hashes every piece
it writes right after storing it — a slice at a time, still in its cache — into the tree nodes
(``formats/blake3_tree.py``) wholly inside what it has stored, and hands them to the parent with
the job's result. A run of contiguous writes is hashed as one: the partial chunk a write ends on
is kept (under 1 KiB) and completed by the first bytes of the write that starts where it ended.
The chunk a run starts in, when it starts inside one, is shared with bytes another job wrote:
the parent hashes it. The nodes of a job's slices are many small ones;
``tree_hashing.hashed_in_worker`` merges siblings (``blake3_tree.compact_nodes``) before they
leave the worker.
"""

from __future__ import annotations

import numpy as np

from hetquant.formats.blake3_tree import CHUNK, range_nodes

__all__ = ["Nodes", "StoredNodes"]

Nodes = tuple[np.ndarray, np.ndarray, np.ndarray]  # (first chunk, chunks, chaining values)


class StoredNodes:
    """Tree nodes of the bytes stored into files of ``sizes`` bytes, since the last take."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self._size = sizes
        # (file, where the last write ended) → (the chunk it ended in: start, its bytes so far);
        # by end, so that writes alternating between two tensors of a file each continue
        self._tails: dict[tuple[str, int], tuple[int, bytes]] = {}
        self._nodes: list[tuple[str, Nodes]] = []
        self._stored = 0  # bytes hashed (or kept in a tail) since the last take

    def stored(self, file: str, pos: int, buf: np.ndarray) -> None:
        """``buf`` (uint8, C-contiguous) is now bytes ``pos .. pos + len(buf)`` of ``file``."""
        size, end = self._size[file], pos + buf.size
        start = pos
        tail = self._tails.pop((file, pos), None)
        if tail is not None:  # continues an earlier write
            at, head = tail
            chunk = np.concatenate((np.frombuffer(head, np.uint8), buf[: CHUNK - len(head)]))
            if chunk.size < CHUNK and at + chunk.size < size:  # still not a whole chunk
                self._tails[file, end] = (at, chunk.tobytes())
                self._stored += buf.size
                return
            self._add(file, range_nodes(size, chunk, at, at, at + chunk.size))
            start = at + chunk.size
        if start < end:
            self._add(file, range_nodes(size, buf, pos, start, end))
        boundary = max(end // CHUNK * CHUNK, -(-start // CHUNK) * CHUNK)  # of the unhashed end
        if end < size and boundary < end:
            self._tails[file, end] = (boundary, buf[boundary - pos :].tobytes())
        self._stored += buf.size

    def take(self) -> tuple[list[tuple[str, Nodes]], int]:
        """((file, nodes) hashed since the last take, the bytes stored since); starts afresh
        (no run continues past a take)."""
        out = (self._nodes, self._stored)
        self._tails, self._nodes, self._stored = {}, [], 0
        return out

    def _add(self, file: str, nodes: Nodes) -> None:
        if len(nodes[0]):
            self._nodes.append((file, nodes))
