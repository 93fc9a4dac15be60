"""The worker side of the convert pool: how a worker starts, runs a job, and dies with its parent.

Two ways to start (``start_method``):

- ``fork`` (Linux, the default there): the parent's opened source, plan and calibration are
  inherited, nothing is rebuilt or loaded; a worker is ready in milliseconds. Not used once this
  process has initialised CUDA (a calibration on the GPU before the jobs): a forked child must not
  touch a CUDA context, and nothing must tempt it to.
- ``spawn`` (elsewhere, or ``HETQUANT_WORKER_START=spawn``): a fresh interpreter opens the source
  and receives the parent's plan pickled (it is data: role shapes are expressions, targets carry
  format objects), loading the calibration the parent saved in the work directory; torch only
  where a job needs it (``native_jobs.py``), else well under a second per worker.

Either way a worker ignores SIGINT (a Ctrl-C reaches the whole process group; the parent
decides), takes SIGTERM's default action, dies with its parent (``PR_SET_PDEATHSIG`` on Linux
plus a watchdog thread that exits when the parent PID changes), reports a SIGBUS (a shard
truncated under its memory map) by its exit status, runs torch (if a job needs it) on one thread
(jobs are block rows, and the pool is the parallelism: ``JobRunner``) at nice +5
(``WORKER_NICE``), and stores into the containers through shared memory maps (``writer.py``:
pwrite into one file serializes writers).

A pool worker keeps the heap it freed (``keep_freed_heap``, glibc's ``mallopt``; not done to
an in-process conversion, whose process may be a caller's). By default glibc maps each block over
its adaptive threshold on its own and returns the heap's free top past twice that, so a job's
block-row buffers (an FP8 block row dequantized is 128 × 7168 × 2 = 1.8 MB) came from fresh pages
every time: a page fault and a zeroed page per 4 KiB — 4 % of an ``ascend-hybrid`` conversion's
CPU in the faults alone at 16 workers, plus the zeroing and the ``brk`` calls (``perf`` on the
16-core host; benchmarks/notes/convert-scaling.md, ninth round). The price: up to 64 MiB of free
heap per malloc arena stays with a worker until it exits (a worker runs its jobs on one thread:
one arena, ~1 GiB over 16 workers at most; measured peaks stay ≤ 0.046× the source).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hetquant.formats._lazy import torch

from ..fs.source_guard import Identity, SourceGuard, job_files
from ..planning.plan import Job, Plan
from ..planning.source import SourceCheckpoint
from .jobs import JobRunner

__all__ = [
    "CALIBRATION_DIR",
    "SIGBUS_STATUS",
    "guarded_run",
    "inherit",
    "init_forked",
    "init_spawned",
    "keep_freed_heap",
    "on_sigbus",
    "restore_sigbus",
    "run",
    "start_method",
]

CALIBRATION_DIR = "calibration"
SIGBUS_STATUS = 128 + signal.SIGBUS  # what a shell shows for a SIGBUS death, without a core dump
START_ENV = "HETQUANT_WORKER_START"
# Workers yield the CPU to the parent's hashing threads: a file's sha256 is one sequential stream
# (~1 GB/s), the critical path once the jobs are fast; the workers have slack.
WORKER_NICE = 5
_PR_SET_PDEATHSIG = 1
_WATCHDOG_SECONDS = 1.0
_LIBC = ctypes.CDLL(None, use_errno=True)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_KEEP_FREED = 64 << 20  # free heap top a worker keeps: a job's buffers, several times over
_MAP_FROM = 32 << 20  # blocks from here on get their own map: glibc's largest threshold (64-bit)
_SIGNAL_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_HANDLERS: list[Any] = []  # the C callbacks must outlive their installation


def start_method() -> str:
    """``fork`` or ``spawn`` (see the module docstring); ``$HETQUANT_WORKER_START`` decides
    when set to one of them."""
    forced = os.environ.get(START_ENV, "").lower()
    if forced in ("fork", "spawn"):
        return forced
    cuda = "torch" in sys.modules and torch.cuda.is_initialized()  # (no torch: no CUDA)
    fork_safe = sys.platform.startswith("linux") and not cuda
    return "fork" if fork_safe else "spawn"


def on_sigbus(line: bytes, status: int) -> int | None:
    """Make a SIGBUS write ``line`` to stderr and ``_exit(status)``; returns the old handler."""

    def handler(signum: int) -> None:  # runs inside the signal: write and leave, nothing else
        os.write(2, line)
        os._exit(status)

    _HANDLERS.append(c_handler := _SIGNAL_HANDLER(handler))
    _LIBC.signal.restype = ctypes.c_void_p
    _LIBC.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return _LIBC.signal(signal.SIGBUS, ctypes.cast(c_handler, ctypes.c_void_p))


def restore_sigbus(previous: int | None) -> None:
    """Put back the SIGBUS handler that :func:`on_sigbus` returned."""
    _LIBC.signal(signal.SIGBUS, previous)


def guarded_run(runner: JobRunner, guard: SourceGuard, job: Job) -> int:
    """Run ``job``, checking the source files it reads before and after (and on failure)."""
    files = job_files(runner.source, job)
    guard.check(files)
    try:
        nbytes = runner.run(job)
    except Exception:
        guard.check(files)  # a source changed under the job explains its failure best
        raise
    guard.check(files)  # what the job read may have changed while it ran
    return nbytes


# what a forked worker takes over from its parent: (source, plan, work dir, calibration)
_INHERITED: tuple[SourceCheckpoint, Any, Path, Any] | None = None
_WORKER: JobRunner | None = None
_GUARD: SourceGuard | None = None
_INIT_ERROR: Exception | None = None
_READY_AT = 0.0  # time.time() when this worker was ready


def inherit(state: tuple[SourceCheckpoint, Any, Path, Any] | None) -> None:
    """Set (before the pool forks) or clear what forked workers take over."""
    global _INHERITED
    _INHERITED = state


def init_forked(parent: int, ids: dict[str, Identity]) -> None:
    """Pool initializer of a forked worker: the inherited source and plan, a fresh runner."""
    global _WORKER
    assert _INHERITED is not None, "inherit() before the pool forks"
    source, plan, work, calibration = _INHERITED
    _setup(parent, source.root, ids)
    _WORKER = JobRunner(source, plan, work, calibration, shared=True)
    _ready()


def init_spawned(
    source_root: str, revision: str | None, plan: Plan, work: str, parent: int,
    ids: dict[str, Identity],
) -> None:  # fmt: skip
    """Pool initializer of a spawned worker: open the source; the plan comes pickled."""
    global _WORKER, _INIT_ERROR
    _setup(parent, Path(source_root), ids)
    try:
        source = SourceCheckpoint.open(source_root, revision)
        calibration = None
        if (Path(work) / CALIBRATION_DIR).exists():
            from hetquant.calib.calibrate import CalibrationResult

            calibration = CalibrationResult.load(Path(work) / CALIBRATION_DIR)
        _WORKER = JobRunner(source, plan, Path(work), calibration, shared=True)
    except Exception as e:  # raised with the first job (the pool would print a traceback)
        _INIT_ERROR = e
    _ready()


def run(job: Job) -> tuple[int, int, float, Any]:
    """Run ``job`` in this worker: (job id, source bytes, when this worker was ready, the tree
    nodes of what it wrote where it hashed them: ``JobRunner.tree_nodes``)."""
    assert _GUARD is not None
    if _WORKER is None:
        _GUARD.check()  # a source changed since the command opened it explains a failure best
        raise _INIT_ERROR or RuntimeError("worker not initialised")
    nbytes = guarded_run(_WORKER, _GUARD, job)
    return job.id, nbytes, _READY_AT, _WORKER.tree_nodes(job)


def _setup(parent: int, root: Path, ids: dict[str, Identity]) -> None:
    global _GUARD
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker has the parent's handler
    _die_with(parent)
    on_sigbus(b"", SIGBUS_STATUS)  # the parent reports it (a changed source, or the death)
    os.nice(WORKER_NICE)
    keep_freed_heap()
    _GUARD = SourceGuard(root, ids)


def keep_freed_heap() -> bool:
    """Make this process's malloc keep what it frees for the next job (module docstring):
    blocks under 32 MiB come from the heap, and up to 64 MiB of free heap top is kept. Fixed
    thresholds also end glibc's adaptive ones. False where the C library has no ``mallopt`` or
    refuses (not glibc)."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    kept = mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED)
    mapped = mallopt(_M_MMAP_THRESHOLD, _MAP_FROM)
    return bool(kept and mapped)


def _ready() -> None:
    global _READY_AT
    _READY_AT = time.time()


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
