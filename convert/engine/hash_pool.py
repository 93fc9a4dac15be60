"""The threads that hash a conversion's containers while its jobs run (``hashing.FileHashes``,
``tree_hashing.TreeHashes``): a pool started once the workers are forked (no thread may run during
a fork; tasks handed in before are queued), the write-back queue beside it, and a wait that
re-raises a hashing thread's error."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..fs.writeback import WritebackQueue

__all__ = ["HashPool"]


class HashPool:
    """Runs :meth:`_task` (a subclass's) for each submitted item on ``threads`` threads."""

    def __init__(self, paths: Mapping[str, Path], threads: int, prefix: str) -> None:
        self._writeback = WritebackQueue(paths)
        self._threads, self._prefix = max(1, threads), prefix
        self._pool: ThreadPoolExecutor | None = None
        self._queued: list[Any] = []
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self.worker_bytes = 0  # bytes whose hashing the workers did (``hashed_elsewhere``)

    def _task(self, item: Any) -> None:
        raise NotImplementedError

    def hashed_elsewhere(self, job_id: int, nodes: Any) -> None:
        """A worker hashed job ``job_id``'s ranges itself (``tree_hashing``); others ignore it."""

    def start(self) -> None:
        """Start hashing (after worker processes are forked: no thread may run during a fork)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._prefix)
            self._writeback.start()
            queued, self._queued = self._queued, []
            for item in queued:
                self._futures.append(self._pool.submit(self._task, item))

    def writeback_stats(self) -> dict[str, float]:
        """Seconds the write-back thread spent in its calls, and GB it handed over."""
        wb = self._writeback
        return {"writeback_busy_s": wb.busy_s, "writeback_gb": wb.handed / 1e9}

    def _submit(self, item: Any) -> None:  # with the lock held
        if self._pool is None:
            self._queued.append(item)
        else:
            self._futures.append(self._pool.submit(self._task, item))

    def _wait(self) -> None:
        """Until no task is left; a hashing thread's error (an OSError) is raised here."""
        while True:
            with self._lock:
                futures, self._futures = self._futures, []
            if not futures:
                return
            for fut in futures:
                fut.result()

    def _shutdown(self) -> None:
        """Stop the threads (what is queued is dropped) and the write-back queue."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._writeback.close()
