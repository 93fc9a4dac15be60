"""An ``OSError`` as the one ``error:`` line the CLI prints: the path, what the OS said, the fix.

``os_error(e)`` names ``e.filename`` and adds a hint chosen by errno (a table, not branches).
``errors_as_hetquant`` wraps a function so that any ``OSError`` escaping it becomes a
``HetquantError`` (exit 2, one line); a full disk has its own message, with the bytes needed
(``convert/diskspace.py``), raised where the plan is known.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from hetquant.formats import HetquantError

__all__ = ["DISK_FULL", "errors_as_hetquant", "os_error"]

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
    errno.ENAMETOOLONG: "choose a shorter path",
}
F = TypeVar("F", bound=Callable[..., Any])


def os_error(e: OSError) -> HetquantError:
    """One line naming the path of ``e``, the OS's reason and what to do."""
    where = e.filename if e.filename is not None else "(no path)"
    if e.filename2 is not None:
        where = f"{where} -> {e.filename2}"
    hint = _HINTS.get(e.errno or 0)
    return HetquantError(f"{where}: {e.strerror or e}" + (f"; {hint}" if hint else ""))


def errors_as_hetquant(fn: F) -> F:
    """Decorator: an ``OSError`` escaping ``fn`` becomes ``os_error(e)``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise os_error(e) from e

    return wrapper  # type: ignore[return-value]
