"""An ``OSError`` as the one ``error:`` line the CLI prints: the path, what the OS said, the fix.

``os_error(e)`` names ``e.filename`` and adds a hint chosen by errno (a table, not branches);
``naming`` gives an error that has no path (ENOMEM, EFBIG, EMFILE) the file being written or
opened, or what was being done.
``errors_as_hetquant`` wraps a function so that any ``OSError`` escaping it becomes a
``HetquantError`` (exit 2, one line); a full disk has its own message, with the bytes needed
(``convert/fs/diskspace.py``), raised where the plan is known.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from hetquant.formats import HetquantError

from .diskspace import free_inodes

__all__ = ["DISK_FULL", "errors_as_hetquant", "naming", "os_error"]

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_HINTS = {
    errno.EROFS: "choose an OUTPUT on a writable file system",
    errno.EACCES: "choose a path you may write, or fix its permissions",
    errno.EPERM: "choose a path you may write, or fix its permissions",
    errno.ENOTDIR: "a component of the path is a file, not a directory; choose another path",
    errno.EISDIR: "a directory stands where a file should be; choose another path",
    errno.EEXIST: "something else already stands at that path; choose another path",
    errno.EIO: "the disk or the network file system failed; check it, then re-run",
    errno.ENOSPC: "free some space, then re-run",
    errno.EDQUOT: "free some space, then re-run",
    errno.EMFILE: "raise the limit (`ulimit -n`), then re-run",
    errno.ENFILE: "the system's open-file table is full; close some programs, then re-run",
    errno.EFBIG: "the file size limit (`ulimit -f`) is below the file's size; raise it, then re-run",
    errno.ENOMEM: "not enough memory (or address space: `ulimit -v`); free some, then re-run",
    errno.EAGAIN: "a process or resource limit was reached (`ulimit -u`); re-run later",
    errno.ENAMETOOLONG: "choose a shorter path",
}
F = TypeVar("F", bound=Callable[..., Any])


def os_error(e: OSError) -> HetquantError:
    """One line naming the path of ``e``, the OS's reason and what to do."""
    where = e.filename if e.filename is not None else "(no path)"
    if e.filename2 is not None:
        where = f"{where} -> {e.filename2}"
    hint = _HINTS.get(e.errno or 0)
    if e.errno == errno.ENOSPC and e.filename is not None and _no_inodes(e.filename):
        hint = "the file system has no free inodes (files) left, though bytes may be free; delete files there, then re-run"  # fmt: skip
    return HetquantError(f"{where}: {e.strerror or e}" + (f"; {hint}" if hint else ""))


def _no_inodes(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    while not p.exists() and p != p.parent:  # the file itself may not have been created
        p = p.parent
    try:
        return free_inodes(p) == 0
    except OSError:
        return False


@contextlib.contextmanager
def naming(what: str | os.PathLike[str]) -> Iterator[None]:
    """An ``OSError`` without a path raised in the block (ENOMEM from ``mmap``, EFBIG from a
    write past ``ulimit -f``, EMFILE from a pipe) names ``what``: the file, or what was done."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(what)) from e


def errors_as_hetquant(fn: F) -> F:
    """Decorator: an ``OSError`` escaping ``fn`` becomes ``os_error(e)``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise os_error(e) from e

    return wrapper  # type: ignore[return-value]
