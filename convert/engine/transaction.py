"""OUTPUT as a transaction: the scaffold convert and export share (plan → validate → execute).

- paths (``fs/lock.py``): SOURCE and OUTPUT apart; OUTPUT empty or hetquant's.
- :meth:`Transaction.held`: OUTPUT locked (``fs/lock.py``); SIGINT / SIGTERM raise
  :class:`Stopped`; an OS error is one ``HetquantError`` line naming the path (a full disk: the
  caller's message); the lock released, the work directory removed when only the lock is left.
- resume: in ``OUTPUT/.hetquant-partial/`` (``fs/workdir.py``) under a plan digest, a finished
  artifact of the same plan is "already complete" (:meth:`~Transaction.finished`), a journal of
  the same digest resumed, jobs reading a changed source file redone, other work refused unless
  ``--overwrite`` (:meth:`~Transaction.resume_or_start`, :meth:`~Transaction.journal`).
- move (``move.py``: ``move_in``): the artifact complete in the work directory replaces OUTPUT's,
  validated before anything changes (``check_move``; before the jobs: ``check_target``); a kill
  leaves no manifest, and re-running the same command finishes the move.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME
from hetquant.formats.manifest_schema import read_manifest

from ..fs.lock import LOCK_NAME, OutputLock, check_paths, refuse_foreign
from ..fs.os_errors import DISK_FULL, os_error
from ..fs.source_guard import Identity
from ..fs.workdir import JOURNAL, WorkDir
from .move import check_move, check_target, move_in, owned_files

__all__ = [
    "Stopped",
    "Transaction",
    "check_move",
    "check_target",
    "move_in",
    "owned_files",
    "stop_on_signals",
]

log = logging.getLogger("hetquant.convert")


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


class Transaction:
    """One command's hold on OUTPUT ``out``, reading ``src`` (module docstring)."""

    def __init__(self, src: Path, out: Path) -> None:
        check_paths(src, out)
        self.src, self.out = src, out
        self.lock = OutputLock(out)
        self.work = WorkDir(self.lock.work)
        self.journaled = 0  # jobs done: resumed, then journaled by this run
        self.jobs = 0  # of the plan

    @contextlib.contextmanager
    def held(self, disk_full: Callable[[], HetquantError] | None = None) -> Iterator[Transaction]:
        """OUTPUT locked, signals stopping, OS errors one line, while the block runs."""
        try:
            with stop_on_signals():
                refuse_foreign(self.out)
                self.lock.acquire()
                yield self
        except Stopped as s:
            raise HetquantError(
                f"interrupted by {s}: {self.journaled} of {self.jobs} jobs are done and journaled "
                f"in {self.lock.work}; re-run the same command to resume"
            ) from None
        except OSError as e:
            if disk_full is not None and e.errno in DISK_FULL:
                raise disk_full() from e
            raise os_error(e) from e
        finally:
            self.lock.release(remove=_only_lock_left(self.lock.work))

    def finished(self, digest: str, overwrite: bool) -> dict[str, Any] | None:
        """The manifest of a complete artifact of this very plan and source in OUTPUT (None:
        work to do); refuses another artifact unless ``overwrite``. Clears scratch a kill left
        after the manifest was written."""
        done = _finished_manifest(self.out, self.src, digest, overwrite, self.work.digest())
        if done is not None:
            self.work.clear()
        return done

    def resume_or_start(
        self, digest: str, overwrite: bool, ids: dict[str, Identity],
        stale: Callable[[set[str]], set[int]], jobs: int,
    ) -> set[int]:  # fmt: skip
        """Journaled jobs to trust (resume), or a fresh start; ``stale``: the jobs that read the
        given source files (changed since the journal began: redone)."""
        self.jobs = jobs
        journal_digest = self.work.digest()
        if journal_digest != digest:
            if journal_digest is not None and not overwrite:
                raise HetquantError(
                    f"OUTPUT {self.out} holds an interrupted convert or export with a different "
                    "source, recipe or options; re-run that command to resume it, or pass --overwrite"
                )
            self.work.start(digest, ids)
            return set()
        done, then = self.work.done(), self.work.recorded_ids()
        changed = {f for f in then.keys() | ids.keys() if then.get(f) != ids.get(f)}
        if changed:
            redo = stale(changed) & done
            log.info("%d source file(s) changed since the interrupted run; redoing the %d jobs that read them", len(changed), len(redo))  # fmt: skip
            done -= redo
            (self.work.path / MANIFEST_NAME).unlink(missing_ok=True)
            self.work.keep_only(digest, done, ids)
        self.journaled = len(done)
        return done

    def journal(self, finished: Iterable[int]) -> Iterator[int]:
        """Journal each job id of ``finished`` as it comes (flushed), then yield it."""
        with open(self.work.path / JOURNAL, "a") as journal:
            for job_id in finished:
                journal.write(f"{job_id}\n")
                journal.flush()
                self.journaled += 1
                yield job_id

    def move_in(self) -> dict[str, Any]:
        """The complete artifact in the work directory into OUTPUT (``move_in``); its manifest."""
        manifest = move_in(self.out, self.work.path)
        self.work.clear()
        return manifest


def _finished_manifest(
    out: Path, source: Path, digest: str, overwrite: bool, journal_digest: str | None
) -> dict[str, Any] | None:
    """The manifest of a complete artifact of this very plan and source directory in ``out``
    (None: work to do); refuses another artifact unless ``overwrite``."""
    if not (out / MANIFEST_NAME).exists():
        return None
    try:
        manifest = read_manifest(out)
    except HetquantError:  # damaged: another artifact, as far as this convert can tell
        manifest = {}
    if overwrite:
        return None
    same = isinstance(manifest, dict) and manifest.get("plan_digest") == digest
    same = same and manifest.get("source", {}).get("path") == str(source)
    if same and manifest.get("complete") is True and _sizes_hold(out, manifest):
        return manifest
    why = "a damaged artifact (run `hetquant verify`)" if same else "an artifact of another source, recipe or options"  # fmt: skip
    resumable = " (an interrupted --overwrite of it is kept: pass --overwrite to resume it)" if journal_digest == digest else ""  # fmt: skip
    raise HetquantError(
        f"OUTPUT {out} already holds {why}; pass --overwrite to replace it{resumable}"
    )


def _sizes_hold(out: Path, manifest: dict[str, Any]) -> bool:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all((out / n).stat().st_size == f["size"] for n, f in files.items())
    except (OSError, TypeError, KeyError):
        return False


def _only_lock_left(work: Path) -> bool:
    try:
        return set(os.listdir(work)) <= {LOCK_NAME}
    except FileNotFoundError:
        return True
    except OSError:  # unreadable: keep whatever is there
        return False
