"""Running a plan's jobs, in this process or a pool of worker processes, and stopping safely.

- Workers die with their parent: ``PR_SET_PDEATHSIG`` (Linux) plus a watchdog thread that exits
  when the parent PID changes (other systems, and a parent that died before the prctl), so an
  OOM kill or SIGKILL of the command leaves no worker writing into OUTPUT. They ignore SIGINT: a
  Ctrl-C reaches the whole process group, and the parent decides.
- SIGINT / SIGTERM in the parent raise :class:`Stopped`; the pool's workers are killed, pending
  jobs cancelled, and what finished is already journaled: the convert resumes.
- Every job checks the source files it reads before and after running (``SourceGuard``). A
  worker killed by SIGBUS (a shard truncated under its memory map) breaks the pool; the parent
  then reports the changed source, or the worker's death. In-process, a SIGBUS cannot be turned
  into a Python exception (the faulting read would repeat), so for the duration of the jobs a
  C-level handler prints the one error line and exits with status 2 (``sigbus_exits``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError

from .jobs import JobRunner
from .plan import Job, Plan, plan_for
from .source import SourceCheckpoint
from .source_guard import Identity, SourceGuard, job_files

__all__ = ["CALIBRATION_DIR", "Stopped", "run_jobs", "sigbus_exits", "stop_on_signals"]

CALIBRATION_DIR = "calibration"
_PR_SET_PDEATHSIG = 1
_SIGBUS_STATUS = 128 + signal.SIGBUS  # what a shell shows for a SIGBUS death, without a core dump
_EXITS = {_SIGBUS_STATUS: "SIGBUS", -signal.SIGKILL: "SIGKILL, e.g. the out-of-memory killer"}
_WATCHDOG_SECONDS = 1.0
_LIBC = ctypes.CDLL(None, use_errno=True)
_SIGNAL_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException: nothing on the way may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    saved = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def sigbus_exits(message: str) -> Iterator[None]:
    """While the block runs, a SIGBUS in this process prints ``error: message`` and exits 2."""
    previous = _on_sigbus(f"error: {message}\n".encode(), 2)
    try:
        yield
    finally:
        _LIBC.signal(signal.SIGBUS, previous)


_HANDLERS: list[Any] = []  # the C callbacks must outlive their installation


def _on_sigbus(line: bytes, status: int) -> int | None:
    """Make a SIGBUS write ``line`` to stderr and ``_exit(status)``; returns the old handler."""

    def on_sigbus(signum: int) -> None:  # runs inside the signal: write and leave, nothing else
        os.write(2, line)
        os._exit(status)

    _HANDLERS.append(handler := _SIGNAL_HANDLER(on_sigbus))
    _LIBC.signal.restype = ctypes.c_void_p
    _LIBC.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return _LIBC.signal(signal.SIGBUS, ctypes.cast(handler, ctypes.c_void_p))


def run_jobs(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], workers: int,
    guard: SourceGuard, progress: Callable[[int], None] | None = None, calibration: Any = None,
) -> Iterator[int]:  # fmt: skip
    """Run ``todo``, yielding each job's id as it finishes (in any order)."""
    if workers <= 1 or len(todo) <= 1:
        yield from _run_here(source, plan, work, todo, guard, progress, calibration)
    else:
        yield from _run_pool(source, plan, work, todo, workers, guard, progress)


def _run_here(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], guard: SourceGuard,
    progress: Callable[[int], None] | None, calibration: Any,
) -> Iterator[int]:  # fmt: skip
    runner = JobRunner(source, plan, work, calibration)
    threads = torch.get_num_threads()
    # One thread, as in the pool's workers: jobs are block-row sized, and per-op thread teams
    # cost more than they save (benchmarks/README.md, bf16 convert).
    torch.set_num_threads(1)
    try:
        for job in todo:
            nbytes = _guarded_run(runner, guard, job)
            if progress:
                progress(nbytes)
            yield job.id
    finally:
        runner.close()
        torch.set_num_threads(threads)


def _guarded_run(runner: JobRunner, guard: SourceGuard, job: Job) -> int:
    files = job_files(runner.source, job)
    guard.check(files)
    try:
        nbytes = runner.run(job)
    except Exception:
        guard.check(files)  # a source changed under the job explains its failure best
        raise
    guard.check(files)  # what the job read may have changed while it ran
    return nbytes


def _run_pool(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], workers: int,
    guard: SourceGuard, progress: Callable[[int], None] | None,
) -> Iterator[int]:  # fmt: skip
    args = (str(source.root), source.revision, plan.recipe, plan.max_shard_size, str(work))
    args += (os.getpid(), guard.ids)
    pool = ProcessPoolExecutor(
        workers, mp_context=get_context("spawn"), initializer=_worker_init, initargs=args
    )
    procs: list[Any] = []
    finished_all = False
    try:
        futures = [pool.submit(_worker_run, j) for j in sorted(todo, key=lambda j: -j.nbytes)]
        procs = list(pool._processes.values())  # spawned by submit; kept to report their deaths
        for fut in as_completed(futures):  # big jobs first (balance), journaled as they finish
            job_id, nbytes = fut.result()
            if progress:
                progress(nbytes)
            yield job_id
        finished_all = True
    except BrokenProcessPool:
        raise HetquantError(_worker_death(guard, procs)) from None
    finally:
        if not finished_all:  # an error, a signal, or the caller stopped: no job may go on
            for p in procs:
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


# the worker side ---------------------------------------------------------------------------------
_WORKER: JobRunner | None = None
_GUARD: SourceGuard | None = None
_INIT_ERROR: Exception | None = None


def _worker_init(
    source_root: str, revision: str | None, recipe: Any, max_shard_size: int, work: str,
    parent: int, ids: dict[str, Identity],
) -> None:  # fmt: skip
    global _WORKER, _GUARD, _INIT_ERROR
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)
    _on_sigbus(b"", _SIGBUS_STATUS)  # the parent reports it (a changed source, or the death)
    torch.set_num_threads(1)
    _GUARD = SourceGuard(Path(source_root), ids)
    try:
        source = SourceCheckpoint.open(source_root, revision)
        calibration = None
        if (Path(work) / CALIBRATION_DIR).exists():
            from hetquant.calib.calibrate import CalibrationResult

            calibration = CalibrationResult.load(Path(work) / CALIBRATION_DIR)
        # The plan is rebuilt here, not sent: it holds role-table lambdas, which cannot be pickled.
        plan = plan_for(source, recipe, max_shard_size)
        _WORKER = JobRunner(source, plan, Path(work), calibration)
    except Exception as e:  # raised with the first job (the pool would print a traceback)
        _INIT_ERROR = e


def _worker_run(job: Job) -> tuple[int, int]:
    assert _GUARD is not None
    if _WORKER is None:
        _GUARD.check()  # a source changed since the command opened it explains a failure best
        raise _INIT_ERROR or RuntimeError("worker not initialised")
    return job.id, _guarded_run(_WORKER, _GUARD, job)


def _die_with(parent: int) -> None:
    """End this process when ``parent`` ends: PDEATHSIG where Linux has it, and a watchdog."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCHDOG_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="hetquant-parent-watchdog", daemon=True).start()
