"""Running a plan's jobs, in this process or a pool of worker processes, and stopping safely.

- Workers (``workers.py``: forked where that is safe, else spawned) die with their parent, so
  an OOM kill or SIGKILL of the command leaves no worker writing into OUTPUT, and ignore SIGINT:
  a Ctrl-C reaches the whole process group, and the parent decides.
- SIGINT / SIGTERM in the parent raise ``transaction.Stopped``; the pool's workers are killed, pending
  jobs cancelled, and what finished is already journaled: the convert resumes.
- Every job checks the source files it reads before and after running (``SourceGuard``). A
  worker killed by SIGBUS (a shard truncated under its memory map) breaks the pool; the parent
  then reports the changed source, or the worker's death. In-process, a SIGBUS cannot be turned
  into a Python exception (the faulting read would repeat), so for the duration of the jobs a
  C-level handler prints the one error line and exits with status 2 (``sigbus_exits``).
- Jobs run in the order given (``hashing.fill_order``); ``on_start`` is called once the workers
  exist (no thread of the caller may run while the pool forks), and ``stats`` receives how the
  workers started and how long until the last was ready.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.native import load_defined

from ..fs.os_errors import naming
from ..fs.source_guard import SourceGuard
from ..planning.plan import Job, Plan
from ..planning.source import SourceCheckpoint
from . import workers as W
from .jobs import JobRunner
from .native_jobs import needs_torch

__all__ = ["CALIBRATION_DIR", "run_jobs", "sigbus_exits"]

CALIBRATION_DIR = W.CALIBRATION_DIR
_EXITS = {W.SIGBUS_STATUS: "SIGBUS", -signal.SIGKILL: "SIGKILL, e.g. the out-of-memory killer"}


@contextlib.contextmanager
def sigbus_exits(message: str) -> Iterator[None]:
    """While the block runs, a SIGBUS in this process prints ``error: message`` and exits 2."""
    previous = W.on_sigbus(f"error: {message}\n".encode(), 2)
    try:
        yield
    finally:
        W.restore_sigbus(previous)


def run_jobs(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], workers: int,
    guard: SourceGuard, progress: Callable[[int], None] | None = None, calibration: Any = None,
    on_start: Callable[[], None] | None = None, stats: dict[str, Any] | None = None,
    on_nodes: Callable[[int, Any], None] | None = None,
) -> Iterator[int]:  # fmt: skip
    """Run ``todo`` (in that order), yielding each job's id as it finishes (in any order); a
    pool worker's tree nodes of what it wrote go to ``on_nodes(job id, nodes)`` first."""
    stats = {} if stats is None else stats
    if workers <= 1 or len(todo) <= 1:
        stats["start_method"] = "in-process"
        if on_start:
            on_start()
        yield from _run_here(source, plan, work, todo, guard, progress, calibration)
    else:
        yield from _run_pool(source, plan, work, todo, workers, guard, progress, calibration, on_start, stats, on_nodes)  # fmt: skip


def _run_here(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], guard: SourceGuard,
    progress: Callable[[int], None] | None, calibration: Any,
) -> Iterator[int]:  # fmt: skip
    runner = JobRunner(source, plan, work, calibration)  # torch, if used, on one thread
    try:
        for job in todo:
            nbytes = W.guarded_run(runner, guard, job)
            if progress:
                progress(nbytes)
            yield job.id
    finally:
        runner.close()


def _run_pool(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], workers: int,
    guard: SourceGuard, progress: Callable[[int], None] | None, calibration: Any,
    on_start: Callable[[], None] | None, stats: dict[str, Any],
    on_nodes: Callable[[int, Any], None] | None,
) -> Iterator[int]:  # fmt: skip
    method = stats["start_method"] = W.start_method()
    if method == "fork":
        load_defined()  # the kernels, built once here rather than in every worker
        if needs_torch(source, todo, () if calibration is None else calibration):
            import torch  # noqa: F401  # once here: shared by the forked workers, not one each
        W.inherit((source, plan, work, calibration))
        init, args = W.init_forked, (os.getpid(), guard.ids)
    else:
        if calibration is not None:
            calibration.save(work / CALIBRATION_DIR)  # spawned workers load it
        init = W.init_spawned
        args = (str(source.root), source.revision, plan, str(work), os.getpid(), guard.ids)
    t0 = time.time()
    with naming(f"(starting {workers} worker processes)"):  # EMFILE from its pipes: no path
        pool = ProcessPoolExecutor(workers, mp_context=get_context(method), initializer=init, initargs=args)  # fmt: skip
    procs: list[Any] = []
    finished_all = False
    try:
        with naming(f"(starting {workers} worker processes)"):  # EMFILE, EAGAIN: no path
            futures = [pool.submit(W.run, j) for j in todo]  # forks (or spawns) the workers
        procs = list(pool._processes.values())  # kept to report their deaths
        W.inherit(None)
        if on_start:
            on_start()
        for fut in as_completed(futures):  # journaled as they finish
            job_id, nbytes, ready_at, nodes = fut.result()
            stats["workers_ready_s"] = round(max(stats.get("workers_ready_s", 0), ready_at - t0), 3)
            if on_nodes:
                on_nodes(job_id, nodes)
            if progress:
                progress(nbytes)
            yield job_id
        finished_all = True
    except BrokenProcessPool:
        raise HetquantError(_worker_death(guard, procs)) from None
    finally:
        W.inherit(None)
        if not finished_all:  # an error, a signal, or the caller stopped: no job may go on
            for p in procs or list((pool._processes or {}).values()):  # some, if start failed
                p.kill()
        pool.shutdown(wait=True, cancel_futures=True)


def _worker_death(guard: SourceGuard, procs: list[Any]) -> str:
    for p in procs:
        p.join(timeout=5)
    codes = list(dict.fromkeys(p.exitcode for p in procs if p.exitcode))
    codes = [c for c in codes if c != -signal.SIGTERM] or codes  # the pool ends the others so
    how = ", ".join(_EXITS.get(c) or (signal.Signals(-c).name if c < 0 else f"exit {c}") for c in codes)  # fmt: skip
    if changed := guard.changed():
        return f"{guard.message(changed)} (a worker died reading it: {how or '?'})"
    return (
        f"a worker process died ({how or '?'}); if it was killed for memory, use fewer "
        "--workers. Finished jobs are journaled: re-run the same command to resume"
    )
