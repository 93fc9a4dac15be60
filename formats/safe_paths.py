"""Names an artifact or a checkpoint gives, kept inside it; only regular files opened.

Everything loaded is untrusted (DESIGN.md, principles): a manifest's ``files``, an index's
shards, the ``cpu_experts`` list may name ``../secret.txt`` or ``/etc/shadow``; a shard may be a
symbolic link to any file, a FIFO (a read never returns) or a device. Every reader — convert's
source, verify, publish, export, the loader, the CPU expert pool — goes through here:

- :func:`inside`: a name a manifest or index gives → its path under ``root``, refused unless it
  is a plain relative name (a string, not absolute, no ``..``) that still lies under ``root``
  with every symbolic link followed. One exception, :func:`allowed_bases`: a snapshot of the
  Hugging Face cache (``…/models--org--name/snapshots/<rev>/``, as ``snapshot_download`` lays it
  out) keeps its files as links to ``../../blobs/<sha>``, so that repo's ``blobs/`` counts as
  inside too. :func:`is_inside` is the same test for a path found by listing a directory.
- :func:`open_regular`: a file opened for reading only if it is a regular file. It is checked
  with ``stat`` first (a device is never opened), opened with ``O_NONBLOCK`` (a FIFO cannot
  block the open) and checked again with ``fstat`` on the opened descriptor, so what was checked
  is what is read even if the name is swapped in between.

Messages name the file that gave the name and the fix, never bytes of the file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import HetquantError

__all__ = ["allowed_bases", "inside", "is_inside", "open_binary", "open_regular", "read_regular"]

_SHOWN = 200  # characters of an untrusted name put in a message
_KINDS = {
    stat.S_ISDIR: "a directory",
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
}


def allowed_bases(root: str | os.PathLike[str]) -> tuple[Path, ...]:
    """Where the files of directory ``root`` may really live: ``root`` itself (resolved) and,
    for a snapshot of the Hugging Face cache (``…/snapshots/<rev>``), the repo's ``blobs/``."""
    real = Path(root).resolve()
    if real.parent.name == "snapshots":
        return real, real.parent.parent / "blobs"
    return (real,)


def is_inside(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Whether ``path``, every symbolic link followed, lies in ``allowed_bases(root)``; a link
    that leads back to itself is refused (HetquantError)."""
    try:
        real = Path(path).resolve()
    except RuntimeError:  # Python 3.11-3.12: "Symlink loop from ..." (3.13 raises OSError)
        raise HetquantError(f"{path}: a symbolic link loop; replace it with the file") from None
    return any(real.is_relative_to(base) for base in allowed_bases(root))


def inside(
    root: str | os.PathLike[str],
    name: object,
    given_by: str | os.PathLike[str],
    what: str = "file",
    kind: str = "artifact",
) -> Path:
    """``root / name`` (as joined, links not resolved) once ``name`` is known to stay inside.

    ``given_by`` is the file that named it (the manifest, the index), ``what`` what it names
    (``"shard"``), ``kind`` what ``root`` is (``"artifact"``, ``"source"``); they make the
    message. Raises HetquantError for a name that is not a string, is empty, absolute, holds
    ``..`` or a NUL, or resolves (links followed) outside :func:`allowed_bases`.
    """
    shown = _shown(name)
    if not isinstance(name, str) or not name or "\0" in name:
        raise HetquantError(
            f"{given_by}: {what} {shown} is not a file name; the {kind}'s metadata is corrupt — "
            f"re-download or re-create the {kind}"
        )
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise HetquantError(
            f"{given_by}: {what} {shown} points outside the {kind} {root}; absolute and '..' "
            f"names are refused — re-download or re-create the {kind}"
        )
    path = Path(root) / rel
    if not is_inside(root, path):
        raise HetquantError(
            f"{given_by}: {what} {shown} is a link to {path.resolve()}, outside the {kind} "
            f"{root}; refusing it — put the file itself in the {kind}"
        )
    return path


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (module docstring); raises
    HetquantError for anything else, OSError (naming ``path``) when it cannot be opened."""
    _require_regular(path, os.stat(path).st_mode)  # before opening: no device is ever opened
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _require_regular(path, os.fstat(fd).st_mode)  # what is read is what was checked
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: str | os.PathLike[str], buffering: int = -1) -> BinaryIO:
    """:func:`open_regular` as a binary file object (``open(path, "rb")`` for untrusted files)."""
    return os.fdopen(open_regular(path), "rb", buffering=buffering)


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of regular file ``path`` (``Path.read_bytes`` for untrusted files)."""
    with open_binary(path) as f:
        return f.read()


def _require_regular(path: str | os.PathLike[str], mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):  # the OS's own error, one line in every command (cli_base)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    kind = next((k for test, k in _KINDS.items() if test(mode)), "a special file")
    raise HetquantError(
        f"{path}: is {kind}, not a regular file; only regular files are read — put the file "
        "itself there"
    )


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}…"
