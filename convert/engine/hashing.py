"""The manifest's digest of every container, computed while the jobs still run.

The digest (BLAKE3 since manifest schema 3; ``formats/file_digests.py``) is computed front to
back, incrementally. As jobs finish, the byte ranges they wrote are marked
(:meth:`FileHashes.written`); a thread advances the file's hash over the contiguous prefix that
is complete, reading it back from the page cache while it is hot. The write-back of every
piece starts as soon as its job reports it (``fs/writeback.py``: one thread, in that order), so
that the final ``fsync`` of each file — done by the hashing thread once the file is whole — has
little left to wait for. The parent of the workers does this. BLAKE3 is a tree hash: one update is spread over a thread pool the file's hasher owns
(every core; the pool goes with the hasher), so what the threads could not follow during the jobs
— the tail, after :meth:`FileHashes.finish` — is hashed in large reads on all cores, not as one
~1 GB/s sha256 stream per file (benchmarks/notes/convert-scaling.md, "The hash tail").

For that, files must fill front to back, several at a time: :func:`fill_order` runs the jobs in
waves of ``width`` files (one per hashing thread; on a tmpfs at least one per worker,
:func:`fill_width`: more files than hashing threads there, whose pool workers hash what they
store), each wave's jobs by their position in their file, files of stacked experts first. Bytes
no job writes (none in a plan; a missing expert would leave zeros) are hashed at
:meth:`FileHashes.finish`, which returns exactly what ``manifest.file_digest`` gives.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetquant.formats.file_digests import DIGESTS, FILE_DIGEST, DigestAlgorithm, Hasher

from ..fs.mounts import memory_backed
from ..fs.os_errors import naming
from ..planning.containers import Container
from ..planning.plan import Job, Plan
from .hash_pool import HashPool
from .manifest import cores, hash_threads

__all__ = ["FileHashes", "fill_order", "fill_width", "hash_threads"]

_SLICE = 256 << 20  # bytes hashed between looks at a stop request


def _ranges(job: Job, where: dict[str, tuple[Container, int]]) -> list[tuple[str, int, int]]:
    """(file, start, end) of every byte range ``job`` writes."""
    out = []
    for piece in job.outputs:
        file, base = where[piece.tensor]
        start = base + piece.offset
        out.append((file.name, start, start + piece.meta.nbytes))
    return out


def _where(plan: Plan) -> dict[str, tuple[Container, int]]:
    return {t: (f, off) for f in plan.files for t, off in f.offsets().items()}


def fill_width(hash_width: int, workers: int, work: Path) -> int:
    """Files :func:`fill_order` fills at once: one per hashing thread (``hash_width``), and where
    the output is in memory (``fs/mounts.py``) at least one per worker. A tmpfs adds every page
    to its file's page cache under that file's lock, so workers writing the same file wait on
    each other; with a file each, a ``bf16`` conversion at 16 workers on the 16-core host spent
    18 % less system time and was 1.13-1.14× faster (benchmarks/notes/convert-scaling.md, tenth
    round). A disk keeps the narrower front: fewer files in write-back at once."""
    if workers > 1 and memory_backed(work):
        return max(hash_width, workers)
    return hash_width


def fill_order(plan: Plan, jobs: list[Job], width: int) -> list[Job]:
    """``jobs`` in the order that fills ``width`` files at a time front to back (see module
    docstring): by wave (the file's place // width), then by the job's first byte relative to
    its file's size, larger jobs first among equals. Files whose jobs each write pieces far
    apart (stacked experts: expert e's rows of every stacked tensor) come first: half such a
    file can only be hashed once its last job is done, so that happens while later waves run."""
    where = _where(plan)
    strided = {r[0][0] for j in plan.jobs if not _adjacent(r := _ranges(j, where))}
    order = sorted(plan.files, key=lambda f: f.name not in strided)  # stable: plan order else
    index = {f.name: i for i, f in enumerate(order)}
    size = {f.name: max(f.size, 1) for f in plan.files}

    def key(job: Job) -> tuple[int, float, int]:
        file, start, _ = min(_ranges(job, where), key=lambda r: r[1])
        return index[file] // width, start / size[file], -job.nbytes

    return sorted(jobs, key=key)


def _adjacent(ranges: list[tuple[str, int, int]]) -> bool:
    """Whether a job's byte ranges form one run of one file."""
    runs = sorted((start, end) for _, start, end in ranges)
    return all(a[1] == b[0] for a, b in itertools.pairwise(runs))


@dataclass
class _File:
    path: Path
    size: int
    ready: int  # the complete prefix: [0, ready) is written
    hashed: int = 0
    pending: dict[int, int] = field(default_factory=dict)  # written ranges past ready
    hasher: Hasher | None = None  # made by the first drain (a BLAKE3 one owns a thread pool)
    running: bool = False
    fd: int | None = None
    digest: dict[str, Any] | None = None


def _work_left(f: _File) -> bool:
    """Bytes to hash, or a whole file to fsync and digest."""
    return f.hashed < f.ready or (f.ready == f.size and f.digest is None)


class FileHashes(HashPool):
    """Hashes of ``plan``'s containers in ``work`` (see the module docstring): ``threads`` files
    at once, each file's hash on up to ``per_file`` threads (default: every core)."""

    def __init__(
        self, plan: Plan, work: Path, threads: int,
        algorithm: DigestAlgorithm = DIGESTS[FILE_DIGEST], per_file: int | None = None,
    ) -> None:  # fmt: skip
        self._alg = algorithm
        self._per_file = per_file or cores()
        self._bulk = False  # after the jobs: large reads, each spread over the hasher's pool
        self._where = _where(plan)
        self._files = {f.name: _File(work / f.name, f.size, len(f.header)) for f in plan.files}
        super().__init__({n: f.path for n, f in self._files.items()}, threads, "hetquant-hash")
        self._stopping = False

    def written(self, job: Job) -> None:
        """``job``'s bytes are in their files: hash what is now a complete prefix."""
        with self._lock:
            for name, start, end in _ranges(job, self._where):
                self._writeback.add(name, start, end)
                f = self._files[name]
                f.pending[start] = end
                while f.ready in f.pending:
                    f.ready = f.pending.pop(f.ready)
                self._kick(f)

    def hashed_bytes(self) -> int:
        """Bytes hashed so far, every file together."""
        with self._lock:
            return sum(f.hashed for f in self._files.values())

    def finish(self) -> dict[str, dict[str, Any]]:
        """Hash every file to its end, fsync it; ``{name: {"size", algorithm: hex}}``."""
        self.start()
        with self._lock:
            self._bulk = True
            for f in self._files.values():
                f.pending.clear()
                f.ready = f.size
                self._kick(f)
        self._wait()
        self.close()
        return {name: f.digest for name, f in self._files.items()}  # type: ignore[misc]

    def close(self) -> None:
        """Stop the threads (an error or a signal: what is queued is dropped) and close files."""
        self._stopping = True  # a running drain stops after its current read
        self._shutdown()
        for f in self._files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None

    def _kick(self, f: _File) -> None:  # with the lock held
        if f.running or not _work_left(f):
            return
        f.running = True
        self._submit(f)

    def _task(self, item: Any) -> None:
        self._drain(item)

    def _drain(self, f: _File) -> None:
        """Hash ``f`` up to its complete prefix, as long as that grows; fsync it when whole."""
        try:
            if f.fd is None:
                with naming(f.path):
                    f.fd = os.open(f.path, os.O_RDONLY)
            if f.hasher is None:
                f.hasher = self._alg.new(self._per_file)
            buf = bytearray(0)
            while True:
                with self._lock:
                    start, end = f.hashed, min(f.ready, f.hashed + _SLICE)
                    read = self._alg.bulk_read if self._bulk else self._alg.stream_read
                    if self._stopping or not _work_left(f):
                        f.running = False
                        return
                if len(buf) != read:
                    buf = bytearray(read)
                self._hash(f, buf, start, end)
                if end == f.size:
                    os.fsync(f.fd)
                    f.digest = {"size": f.size, self._alg.name: f.hasher.hexdigest()}
                    f.hasher = None  # its thread pool ends here
                with self._lock:
                    f.hashed = end
        except BaseException:
            with self._lock:
                f.running = False
            raise

    @staticmethod
    def _hash(f: _File, buf: bytearray, start: int, end: int) -> None:
        view, pos = memoryview(buf), start
        assert f.fd is not None and f.hasher is not None
        while pos < end:
            n = os.preadv(f.fd, [view[: min(len(buf), end - pos)]], pos)
            if n <= 0:
                raise OSError(f"{f.path}: unexpected end of file at byte {pos} of {f.size}")
            f.hasher.update(view[:n])
            pos += n
