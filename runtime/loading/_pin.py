"""Loads that never mix two artifacts: the manifest an artifact was opened with, held open.

A convert (or export) replaces an artifact by renames only (``convert/engine/move.py``): its old
manifest goes first, then the files, the new manifest last; no file is rewritten in place. So a
reader that

1. opens the manifest and keeps it open (``ManifestPin``: while its descriptor lives, no other
   file can take its inode number),
2. opens every file it will read (an open descriptor keeps reading the file it opened, whatever
   is renamed over its name later), and then
3. finds the manifest path still naming the inode it holds (``check``)

has opened only files of that one artifact: had a replacement begun in between, the manifest at
the path would be gone or another inode. What it then reads comes from those descriptors (or
their memory maps). No hashing, one ``stat`` per check. A failed check is an error naming the
artifact (``open_artifact`` first tries again: a replacement is brief).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from hetquant.formats.errors import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME
from hetquant.formats.json_io import require_json_size

__all__ = ["ManifestPin", "Replaced", "open_pinned"]

T = TypeVar("T")
_ATTEMPTS = 3  # a replacement is a few renames: a second try finds it finished


class Replaced(HetquantError):
    """The artifact was replaced (a convert or export into its directory) while being read."""


class ManifestPin:
    """``root/hetquant.json``, opened and held until ``close`` (or garbage collection)."""

    def __init__(self, root: Path) -> None:
        self.root, self.path = root, root / MANIFEST_NAME
        try:  # O_NONBLOCK: a FIFO in its place must not block the open
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise HetquantError(
                f"{self.path}: missing (no {MANIFEST_NAME}: not a complete hetquant artifact, "
                "or its conversion did not finish)"
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            if stat.S_ISDIR(st.st_mode):  # what reading it would say
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(self.path))
            raise HetquantError(f"{self.path}: not a regular file; not a hetquant artifact")
        self.fd, self.generation = fd, (st.st_dev, st.st_ino)
        self._closer = weakref.finalize(self, os.close, fd)

    def read(self) -> bytes:
        """The manifest's bytes, as opened; refused past the JSON limit, as ``load_json``
        refuses any JSON file."""
        size, chunks, pos = os.fstat(self.fd).st_size, [], 0
        require_json_size(self.path, size)
        while chunk := os.pread(self.fd, max(size - pos, 1 << 16), pos):
            chunks.append(chunk)
            pos += len(chunk)
            require_json_size(self.path, pos)  # grown since
        return b"".join(chunks)

    def current(self) -> bool:
        """Whether the manifest path still names the manifest this pin holds."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.generation

    def check(self, when: str) -> None:
        """Raise ``Replaced`` unless ``current``; ``when``: what was being done."""
        if not self.current():
            raise Replaced(
                f"{self.root}: the artifact was replaced {when} (a convert or export into its "
                "directory); nothing of it is used — open it again once that has finished"
            )

    @contextlib.contextmanager
    def explaining(self, when: str) -> Iterator[None]:
        """A failure in the block (a file gone, truncated) is ``Replaced`` when the artifact was
        replaced meanwhile, which explains it."""
        try:
            yield
        except Exception:
            self.check(when)
            raise

    def close(self) -> None:
        self._closer()


def open_pinned(root: Path, read: Callable[[ManifestPin], T]) -> T:
    """``read(pin)`` of the artifact at ``root``, all of one artifact: tried again when it was
    replaced meanwhile (whatever ``read`` raised then), up to ``_ATTEMPTS`` times."""
    for _ in range(_ATTEMPTS):
        pin = ManifestPin(root)
        try:
            got = read(pin)
            pin.check("while it was being opened")
        except Exception:
            replaced = not pin.current()  # asked while the pin still holds its inode
            pin.close()
            if replaced:
                continue
            raise
        return got
    raise Replaced(
        f"{root}: replaced {_ATTEMPTS} times while being opened (a convert or export into its "
        "directory); open it again once that has finished"
    )
