"""Starting the write-back of bytes just written, so the output reaches the disk during the jobs.

A conversion writes its output through the page cache. Left alone, the kernel writes dirty pages
back only past ``dirty_background_ratio`` of memory (10 %: 25 GB on a 256 GB host) or after 30 s,
so on a large host a whole 12 GB artifact can sit dirty until the final ``fsync`` — and the disk
then writes it all after the last job, a tail as long as the write itself (issue 30, measured on
the 32-core host: ``benchmarks/notes/convert-scaling.md``). ``sync_file_range(...,
SYNC_FILE_RANGE_WRITE)`` (Linux) starts the write-back of a byte range; it waits only where the
device's queue is full. :class:`WritebackQueue` is one thread of the converting process that does
this for every piece as soon as its job reports it written, in that order: the disk works while
the jobs run and the final ``fsync`` finds little left. The workers never wait on the disk: when
each worker started its own pieces' write-back (tried on the 32-core host), the bf16 recipe,
whose output is twice its source, got slower — 32 writers blocking on the queue with scattered
ranges kept the disk below the rate one ordered stream reaches — while the 4-bit recipes gained
(``benchmarks/notes/convert-scaling.md``). Where the call does not exist (other systems) or the
file system ignores it (tmpfs), nothing changes.

Only whole pages inside a range are handed over: a page shared with a neighbouring piece that
another worker may still be writing is left to the final ``fsync``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PAGE", "WritebackQueue", "start_writeback", "whole_pages", "writeback_available"]

PAGE = mmap.PAGESIZE
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start write-back of dirty pages, do not wait for it
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_CALL = getattr(_LIBC, "sync_file_range", None)
if _CALL is not None:
    _CALL.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def writeback_available() -> bool:
    """Whether this system has ``sync_file_range``."""
    return _CALL is not None


def whole_pages(start: int, length: int) -> tuple[int, int]:
    """``(first, nbytes)``: the whole pages inside ``[start, start + length)`` (nbytes may be 0)."""
    first = -(-start // PAGE) * PAGE
    end = (start + length) // PAGE * PAGE
    return first, max(0, end - first)


def start_writeback(fd: int, start: int, length: int) -> None:
    """Start writing back the whole pages of ``fd``'s ``[start, start + length)``; errors are
    left to the ``fsync`` that ends the file (it reports a failed write-back)."""
    first, n = whole_pages(start, length)
    if _CALL is not None and n:
        _CALL(fd, first, n, _WRITE)


class WritebackQueue:
    """One thread starting the write-back of byte ranges of ``paths`` (``{name: path}``) in the
    order :meth:`add` hands them in. Start it after worker processes are forked (no thread may
    run during a fork); :meth:`close` drops what is still queued (each file's ``fsync`` writes
    it, or an error ends the conversion) and ends the thread. Failures are left to that
    ``fsync``: write-back only ever starts early what it does."""

    def __init__(self, paths: Mapping[str, Path]) -> None:
        self._paths = dict(paths)
        self._queue: queue.SimpleQueue[tuple[str, int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._fds: dict[str, int] = {}
        self._closing = False
        self.busy_s = 0.0  # seconds spent in the write-back calls (blocked on the device queue)
        self.handed = 0  # bytes handed to them

    def start(self) -> None:
        if self._thread is None and writeback_available():
            self._thread = threading.Thread(
                target=self._run, name="hetquant-writeback", daemon=True
            )
            self._thread.start()

    def add(self, name: str, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of file ``name`` are written: start their write-back."""
        if self._thread is not None:
            self._queue.put((name, start, end))

    def close(self) -> None:
        if self._thread is not None:
            self._closing = True
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            name, start, end = item
            if self._closing:
                continue
            try:
                fd = self._fds.get(name)
                if fd is None:
                    fd = self._fds[name] = os.open(self._paths[name], os.O_RDONLY)
                t0 = time.perf_counter()
                start_writeback(fd, start, end - start)
                self.busy_s += time.perf_counter() - t0
                self.handed += end - start
            except OSError:
                continue  # the file's fsync reports what went wrong
