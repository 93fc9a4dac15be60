"""Disk space: what a convert still needs, from the plan's exact sizes, against what is free —
in bytes, and in inodes (files), which a file system can run out of with bytes to spare.

Checked before any job runs (files are then created with ``fallocate``, which reserves their
blocks, see ``containers.allocate``), and again when the disk fills anyway (another writer, a
file system without ``fallocate``): both end in one line with the bytes needed and free. The
work is kept, so re-running the same command after freeing space resumes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from hetquant.formats import HetquantError

if TYPE_CHECKING:
    from ..planning.containers import Container

__all__ = ["free_bytes", "free_inodes", "inode_error", "space_error", "space_needed"]

_MIB = 1 << 20


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def free_inodes(path: str | os.PathLike[str]) -> int | None:
    """Files an unprivileged writer may still create on the file system of ``path``; None where
    it sets no such limit (``f_files`` 0: btrfs, some network file systems)."""
    st = os.statvfs(path)
    return st.f_favail if st.f_files else None


def space_needed(files: Iterable[Container], work: Path, extra: Iterable[int]) -> int:
    """Bytes still to allocate: each container at its exact size less the blocks its work file
    already holds, and the ``extra`` files (JSON, tokenizer) — each rounded up to whole blocks,
    plus 1 MiB for directories and the journal."""
    block = os.statvfs(work).f_frsize or 4096
    need = _MIB + sum(_blocks(n, block) for n in extra)
    for f in files:
        need += max(0, _blocks(f.size, block) - _allocated(work / f.name))
    return need


def space_error(out: Path, need: int, free: int, *, early: bool) -> HetquantError:
    when = "" if early else " (the disk filled up during the run)"
    return HetquantError(
        f"OUTPUT {out}: not enough disk space{when}: the artifact needs {need:,} more bytes, "
        f"{free:,} free; free some space or choose another OUTPUT, then re-run the same command "
        "(finished work is kept and resumed)"
    )


def inode_error(out: Path, need: int, free: int, *, early: bool) -> HetquantError:
    when = "" if early else " (they ran out during the run)"
    return HetquantError(
        f"OUTPUT {out}: no free inodes{when}: its file system can create {free:,} more files, "
        f"the artifact needs {need:,} (bytes are not the problem); delete files there or choose "
        "another OUTPUT, then re-run the same command (finished work is kept and resumed)"
    )


def _blocks(n: int, block: int) -> int:
    return -(-n // block) * block


def _allocated(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
