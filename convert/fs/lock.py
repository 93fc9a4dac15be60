"""One convert per OUTPUT: an exclusive ``flock`` on ``OUTPUT/.hetquant-partial/lock``.

The lock file holds the owner's PID and host, so the loser of a race can say who holds it (on a
file system that cannot lock at all, a warning says so and the convert goes on unlocked). The
kernel drops the lock when its owner dies, however it dies, so a stale file locks nothing. The
lock file lives in the work directory, which the engine never deletes while it runs (it empties
it but for the lock); the owner removes it last, when the artifact is complete. Because a loser
may open the file just before the owner unlinks it, a winner checks that the file it locked is
still the one at the path, and tries again if not.

Before locking: SOURCE and OUTPUT must not contain each other (``check_paths``), and OUTPUT must
be empty or hold a hetquant artifact or work (``refuse_foreign``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME, PARTIAL_DIR

__all__ = ["LOCK_NAME", "OutputLock", "check_paths", "refuse_foreign"]

LOCK_NAME = "lock"
_HELD: set[int] = set()  # descriptors of the locks this process holds


def _drop_in_child() -> None:
    """A forked child (a convert worker) closes its copies of the lock descriptors: a flock is
    dropped only once every descriptor of it is closed, so a worker still exiting after its
    parent died would otherwise keep OUTPUT locked against the re-run that resumes it."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)
_ATTEMPTS = 50  # only a convert finishing at that very moment makes an attempt fail
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # e.g. NFS without a lock manager
log = logging.getLogger("hetquant.convert")


class OutputLock:
    """Held for the whole convert into ``out``; creates ``out`` and its work directory."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.work = out / PARTIAL_DIR
        self.path = self.work / LOCK_NAME
        self.created_out = False
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        self.created_out = not self.out.exists()
        for _ in range(_ATTEMPTS):
            self.work.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the work directory went away under us
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(fd)
                os.close(fd)
                raise HetquantError(
                    f"OUTPUT {self.out} is in use by {owner} (another hetquant convert); wait "
                    "for it to finish, or stop it and re-run"
                ) from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                log.warning("%s: this file system cannot lock (%s); make sure no other convert writes into OUTPUT", self.path, e.strerror)  # fmt: skip
            if _is_current(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
                self._fd = fd
                _HELD.add(fd)
                return self
            os.close(fd)  # we locked a file its owner had just removed
        raise HetquantError(f"OUTPUT {self.out}: could not take its lock {self.path}; re-run")

    def release(self, *, remove: bool) -> None:
        """Drop the lock; with ``remove``, delete the lock file and the (emptied) work directory,
        and OUTPUT itself if this convert created it and left it empty."""
        if self._fd is None:
            return
        if remove:
            _unlink_quietly(self.path)
            for d in (self.work, self.out) if self.created_out else (self.work,):
                try:
                    d.rmdir()
                except OSError:  # not empty (a resumable run, or a rival's new lock): keep it
                    break
        _HELD.discard(self._fd)
        os.close(self._fd)
        self._fd = None


def _owner(fd: int) -> str:
    try:
        pid, _, host = os.pread(fd, 256, 0).decode().strip().partition(" ")
    except (OSError, UnicodeDecodeError):
        pid, host = "", ""
    if not pid.isdigit():
        return "another process"
    return f"PID {pid}" if host in ("", socket.gethostname()) else f"PID {pid} on host {host}"


def _is_current(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def check_paths(src: Path, out: Path) -> None:
    if out == src or out.is_relative_to(src):
        raise HetquantError(
            f"OUTPUT {out} is inside SOURCE {src}; the source is never written — choose another OUTPUT"
        )
    if src.is_relative_to(out):
        raise HetquantError(f"SOURCE {src} is inside OUTPUT {out}; choose another OUTPUT")


def refuse_foreign(out: Path) -> None:
    """OUTPUT must be a directory that is empty, or holds a hetquant artifact or work."""
    if out.exists() and not out.is_dir():
        raise HetquantError(f"OUTPUT {out} is a file, not a directory; choose a directory")
    ours = (out / MANIFEST_NAME).exists() or (out / PARTIAL_DIR).exists()
    if out.exists() and not ours and any(out.iterdir()):
        raise HetquantError(
            f"OUTPUT {out} is not empty and not a hetquant artifact; choose a new or empty "
            "directory (it is never deleted, even with --overwrite)"
        )
