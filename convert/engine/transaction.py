"""OUTPUT as a transaction: the scaffold convert and export share (plan → validate → execute).

- paths (``fs/lock.py``): SOURCE and OUTPUT apart; OUTPUT empty or hetquant's.
- :meth:`Transaction.held`: OUTPUT locked (``fs/lock.py``); SIGINT / SIGTERM raise
  :class:`Stopped`; an OS error is one ``HetquantError`` line naming the path (a full disk: the
  caller's message); the lock released, the work directory removed when only the lock is left.
- resume: in ``OUTPUT/.hetquant-partial/`` (``fs/workdir.py``) under a plan digest, a finished
  artifact of the same plan is "already complete" (:meth:`~Transaction.finished`), a journal of
  the same digest resumed, jobs reading a changed source file redone, other work refused unless
  ``--overwrite`` (:meth:`~Transaction.resume_or_start`, :meth:`~Transaction.journal`).
- move (``move_in``): the artifact complete in the work directory replaces OUTPUT's. Planned from
  the new manifest and the files hetquant wrote before (OUTPUT's manifest, or what an interrupted
  move recorded: ``OWNED``; the rest is the user's, kept); validated before anything changes
  (``check_move``; before the jobs, without contents: ``check_target``): no file of the user's
  replaced by another, nothing where a file or directory must go, a probe renamed into every
  receiving directory (EXDEV); executed as: names recorded, old manifest removed, new files
  renamed in, files only the old artifact had removed, the new manifest last. A kill leaves no
  manifest; re-running the same command finishes the move.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.file_digests import DIGESTS
from hetquant.formats.filenames import MANIFEST_NAME, PARTIAL_DIR
from hetquant.formats.manifest_schema import read_manifest

from ..fs.lock import LOCK_NAME, OutputLock, check_paths, refuse_foreign
from ..fs.os_errors import DISK_FULL, os_error
from ..fs.source_guard import Identity
from ..fs.workdir import JOURNAL, OWNED, WorkDir
from .manifest import file_digest, write_json_atomic

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
_PROBE = ".hetquant-probe"
Want = Mapping[str, Any] | Path | None  # what a new file will be (see ``_differs``)


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


def owned_files(out: Path) -> set[str]:
    """The files hetquant wrote into ``out`` (relative names): those its manifest lists, or,
    while a move is unfinished, those it recorded (``OWNED``); and the manifest."""
    for path in (out / MANIFEST_NAME, out / PARTIAL_DIR / OWNED):
        files = _listed(path)
        if files is not None:
            return {n for n in files if _relative(n)} | {MANIFEST_NAME}
    return {MANIFEST_NAME}


def _relative(name: str) -> bool:
    """Whether ``name`` (from a manifest: untrusted) names a path below OUTPUT: not absolute,
    no ``..``."""
    rel = Path(name)
    return bool(rel.parts) and not rel.is_absolute() and ".." not in rel.parts


def _listed(path: Path) -> set[str] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    return {n for n in files if isinstance(n, str)} if isinstance(files, dict | list) else None


def check_target(out: Path, work: Path, names: Mapping[str, Path | None]) -> None:
    """Before the jobs: refuse what ``check_move`` would refuse of the files ``names`` (name →
    the file it will be a copy of, None: bytes not known yet)."""
    _check(out, work, {**names, MANIFEST_NAME: None}, owned_files(out))


def check_move(out: Path, work: Path, new: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse, changing nothing, a move of ``new`` (name → size and digest) into ``out``; files
    an interrupted earlier move already took out of ``work`` are in place, not checked."""
    left = {n: d for n, d in new.items() if os.path.lexists(work / n)}
    _check(out, work, left | {MANIFEST_NAME: None}, owned_files(out))


def _check(out: Path, work: Path, new: Mapping[str, Want], owned: set[str]) -> None:
    clash = [n for n in sorted(new) if n not in owned and _differs(out / n, new[n])]
    if clash:
        shown = ", ".join(clash[:5]) + (f" and {len(clash) - 5} more" if len(clash) > 5 else "")
        raise HetquantError(
            f"OUTPUT {out}: {shown} {'is' if len(clash) == 1 else 'are'} not part of the artifact "
            "there, and the new artifact writes the same name; move it away, then re-run the same "
            "command (nothing in OUTPUT was changed)"
        )
    for d in sorted({_existing_parent(out, n) for n in new}):
        _probe_rename(out, work, d)


def _differs(path: Path, want: Want) -> bool:
    """Whether a file of the user's at ``path`` would be lost by writing ``want`` there: a
    manifest's size and digest (of any known algorithm: a work directory's manifest may be an
    older hetquant's), a file of the same bytes, or None (not known: any file)."""
    if not os.path.lexists(path):
        return False
    if isinstance(want, Path):
        want = file_digest(want)
    if want is None or not path.is_file() or path.stat().st_size != want.get("size"):
        return True
    alg = next((DIGESTS[k] for k in want if k in DIGESTS), None)
    return alg is None or file_digest(path, alg)[alg.name] != want[alg.name]


def _existing_parent(out: Path, name: str) -> Path:
    """The directory that receives ``name``, or its nearest existing ancestor."""
    d = (out / name).parent
    while d != out and not d.exists():
        d = d.parent
    if d.exists() and not d.is_dir():
        raise HetquantError(
            f"OUTPUT {out}: {d} is a file where the new artifact needs a directory; move it away "
            "(nothing in OUTPUT was changed)"
        )
    return d


def _probe_rename(out: Path, work: Path, target: Path) -> None:
    """Rename an empty file from ``work`` into ``target`` and back: the move's renames work."""
    src, dst = work / _PROBE, target / _PROBE
    src.touch()
    try:
        os.rename(src, dst)
    except OSError as e:
        src.unlink()
        if e.errno != errno.EXDEV:
            raise OSError(e.errno, e.strerror, str(target)) from None
        raise HetquantError(
            f"OUTPUT {out}: {target} is on another file system than OUTPUT (a symbolic link?), "
            "and finished files are moved in by rename, which cannot cross file systems; make it "
            "a directory on OUTPUT's file system, or convert into another OUTPUT (nothing in "
            "OUTPUT was changed)"
        ) from None
    os.rename(dst, src)
    src.unlink()


def move_in(out: Path, work: Path) -> dict[str, Any]:
    """Replace the artifact in ``out`` by the complete one in ``work`` (module docstring)."""
    manifest = json.loads((work / MANIFEST_NAME).read_text())
    new = manifest["files"]
    owned = owned_files(out)
    check_move(out, work, new)
    write_json_atomic(work / OWNED, {"files": sorted(owned | set(new))})
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for name in sorted(new):
        if (work / name).exists():  # else moved by an interrupted earlier move_in
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(work / name, out / name)
    _remove(out, owned - set(new) - {MANIFEST_NAME})
    os.replace(work / MANIFEST_NAME, out / MANIFEST_NAME)
    (work / OWNED).unlink()
    _fsync_dir(out)
    return manifest


def _remove(out: Path, names: set[str]) -> None:
    """Delete the files ``names`` and hetquant's temporary names of them, then the directories
    this left empty (a directory holding a file of the user's stays); nothing where a linked
    directory leads out of ``out``."""
    dirs, root = set(), out.resolve()
    for name in sorted(names):
        if not (out / name).parent.resolve().is_relative_to(root):
            continue  # a linked directory leads out of OUTPUT: never delete there
        for p in (out / name, (out / name).with_name(f".{Path(name).name}.tmp")):
            if p.is_symlink() or p.is_file():
                p.unlink()
        dirs.update(d for d in (out / name).parents if d.is_relative_to(out) and d != out)
    for d in sorted(dirs, key=lambda d: -len(d.parts)):  # children before their parents
        if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
