"""The containers' BLAKE3 digests from pieces hashed as their jobs report them, in any order.

:class:`FileHashes` (``hashing.py``) follows each file's complete prefix: a file whose first
bytes come last (a stacked-expert file: expert e's rows of every stacked tensor) is hashed only
after its last job, so part of every conversion's hashing was left for after the jobs (issue 30:
12-34 % of the wall on tmpfs at 32 workers, benchmarks/notes/convert-scaling.md). BLAKE3 is a
tree hash: every aligned power-of-two run of 1 KiB chunks is a node whose chaining value depends
on its bytes and place only (``formats/blake3_tree.py``). So here each range a job wrote is hashed
as soon as the job reports it, on a pool of threads of this process (the C++ releases the GIL),
reading it back (``pread``, 4 MiB at a time) while its pages are hot; :meth:`finish` only
hashes the chunks that straddle two pieces, merges the nodes to each file's digest, and fsyncs.
The digest is the standard BLAKE3 of the file, the same string ``FileHashes`` gives
(tests/convert/engine/test_hashing.py runs both).

A pool worker hashes the nodes of what it stores itself, a slice at a time while the slice is in
its cache, through a map of the output or with ``pwrite`` (``PieceWriter(hash_nodes=True)``,
``stored_nodes.py``), and sends them with the job's result
(:func:`hashed_in_worker`): no ``pread`` copy into a buffer and no second pass over memory
(benchmarks/notes/convert-scaling.md, seventh and eighth rounds). The pool threads then only
take the nodes in and fsync.

Write-back starts per piece as in ``FileHashes`` (``fs/writeback.py``); a file is fsynced by a
pool thread as soon as all its bytes are written, else by :meth:`finish`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetquant.formats import blake3_tree
from hetquant.formats.blake3_tree import CHUNK, TreeDigest, compact_nodes, covered_bytes
from hetquant.formats.file_digests import DIGESTS, FILE_DIGEST

from ..fs.os_errors import naming
from ..planning.plan import Job, Plan
from .hash_pool import HashPool
from .hashing import FileHashes, _ranges, _where
from .stored_nodes import Nodes
from .writer import PieceWriter

__all__ = ["Nodes", "TreeHashes", "container_hashes", "hashed_in_worker", "tree_digests"]


def container_hashes(plan: Plan, work: Path, threads: int) -> TreeHashes | FileHashes:
    """The hasher of a conversion: :class:`TreeHashes` where the manifest's digest is BLAKE3 and
    the subtree kernel is built, else :class:`FileHashes` (front to back, the ``blake3`` package)."""
    if tree_digests():
        return TreeHashes(plan, work, threads)
    return FileHashes(plan, work, threads, DIGESTS[FILE_DIGEST])


def tree_digests() -> bool:
    """Whether the manifest's digest is this tree's and its kernel is built."""
    return FILE_DIGEST == TreeHashes.name and blake3_tree.available()


def hashed_in_worker(out: PieceWriter, job: Job) -> list[Nodes] | None:
    """The tree nodes of each byte range ``job`` wrote (in ``_ranges`` order), which ``out``
    hashed as it stored them (``PieceWriter.take_nodes``); None where it did not hash (no
    ``hash_nodes``), did not store exactly those bytes itself (a node outside them, or two
    over the same bytes: a range stored twice), or the manifest's digest is not this tree's:
    the parent's threads then read the ranges back."""
    taken = out.take_nodes()
    if taken is None or not tree_digests():
        return None
    ranges = _ranges(job, out.where)
    if taken[1] != sum(end - start for _, start, end in ranges):
        return None
    by_file: dict[str, list[Nodes]] = {}
    for file, nodes in taken[0]:
        by_file.setdefault(file, []).append(nodes)
    joined = {f: _sorted_disjoint(out.sizes[f], parts) for f, parts in by_file.items()}
    if any(nodes is None for nodes in joined.values()):
        return None
    empty = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, 32), np.uint8))
    out_nodes, placed = [], 0
    for name, start, end in ranges:
        first, k, cv = joined.get(name, empty)
        at = (first * CHUNK >= start) & (first * CHUNK < end)  # a node starts inside the range
        out_nodes.append((first[at], k[at], cv[at]))
        placed += int(at.sum())
    return out_nodes if placed == sum(len(n[0]) for n in joined.values()) else None


def _sorted_disjoint(size: int, parts: list[Nodes]) -> Nodes | None:
    """``parts`` (nodes of a file of ``size`` bytes) joined in chunk order, siblings merged
    (``compact_nodes``: one node per slice stored becomes about one per 4 MiB); None where
    two nodes overlap."""
    first, k, cv = (np.concatenate(p) for p in zip(*parts, strict=True))
    order = np.argsort(first, kind="stable")
    first, k, cv = first[order], k[order], cv[order]
    if (first[1:] < first[:-1] + k[:-1]).any():
        return None
    return compact_nodes(size, first, k, cv)


@dataclass
class _File:
    path: Path
    size: int
    header: int
    written: int = 0  # bytes reported written (pieces do not overlap)
    fd: int | None = None
    tree: TreeDigest | None = None
    synced: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class TreeHashes(HashPool):
    """BLAKE3 digests of ``plan``'s containers in ``work`` (module docstring), hashed on
    ``threads`` threads; the interface of :class:`~.hashing.FileHashes`."""

    name = "blake3"

    def __init__(self, plan: Plan, work: Path, threads: int) -> None:
        self._where = _where(plan)
        self._files = {f.name: _File(work / f.name, f.size, len(f.header)) for f in plan.files}
        super().__init__({n: f.path for n, f in self._files.items()}, threads, "hetquant-tree")
        self._queued = [(n, 0, f.header, None) for n, f in self._files.items() if f.header]
        self._from_workers: dict[int, list[Nodes]] = {}

    def hashed_elsewhere(self, job_id: int, nodes: list[Nodes] | None) -> None:
        """The worker that ran job ``job_id`` hashed its ranges (``hashed_in_worker``)."""
        if nodes is not None:
            self._from_workers[job_id] = nodes

    def written(self, job: Job) -> None:
        """``job``'s bytes are in their files: hash the tree nodes inside them (or take those
        its worker hashed)."""
        nodes = self._from_workers.pop(job.id, None)
        with self._lock:
            for i, (name, start, end) in enumerate(_ranges(job, self._where)):
                self._writeback.add(name, start, end)
                self._submit((name, start, end, None if nodes is None else nodes[i]))
                if nodes is not None:
                    self.worker_bytes += covered_bytes(self._files[name].size, *nodes[i][:2])

    def hashed_bytes(self) -> int:
        return sum(f.tree.hashed for f in self._files.values() if f.tree is not None)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Every file's ``{"size", "blake3": hex}``, each fsynced."""
        self.start()
        self._wait()
        assert self._pool is not None
        names = list(self._files)
        digests = self._pool.map(self._digest, names)
        out = dict(zip(names, digests, strict=True))
        self.close()
        return out

    def close(self) -> None:
        """Stop the threads (what is queued is dropped) and close the files."""
        self._shutdown()
        for f in self._files.values():
            f.tree = None
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None

    def _task(self, item: tuple[str, int, int, Nodes | None]) -> None:
        self._add(*item)

    def _open(self, f: _File) -> TreeDigest:
        with f.lock:
            if f.tree is None:
                with naming(f.path):
                    f.fd = os.open(f.path, os.O_RDONLY)
                    if os.fstat(f.fd).st_size < f.size:
                        raise OSError(f"{f.path}: shorter than its {f.size} bytes")
                f.tree = TreeDigest(f.size, fd=f.fd, path=str(f.path))
            return f.tree

    def _add(self, name: str, start: int, end: int, nodes: Nodes | None) -> None:
        f = self._files[name]
        tree = self._open(f)
        if nodes is None:
            tree.add(start, end)
        else:
            tree.add_nodes(*nodes)
        with f.lock:
            f.written += end - start
            whole = f.written == f.size and not f.synced
            f.synced |= whole
        if whole:
            os.fsync(f.fd)  # type: ignore[arg-type]

    def _digest(self, name: str) -> dict[str, Any]:
        f = self._files[name]
        tree = self._open(f)
        if not f.synced:
            os.fsync(f.fd)  # type: ignore[arg-type]
            f.synced = True
        return {"size": f.size, self.name: tree.hexdigest()}
