"""Which file system a path lives on (Linux ``/proc/self/mountinfo``), and whether it is memory.

The converter writes its output through shared memory maps where the output lives in memory
(tmpfs: no write-back, and ``pwrite`` into one file serializes on its inode lock) and with
``pwrite`` where a disk takes it: there the disk is the bound, and on the 16-core host its
write-back ran at 1.35 GB/s during the jobs with the workers' maps and at 1.77 GB/s with
``pwrite`` (the limit's plain writes: ~2 GB/s) — cleaning pages that sit in another process's
map costs the write-back thread (``engine/writer.py``; benchmarks/notes/convert-scaling.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["MEMORY_FS", "file_system_type", "memory_backed"]

MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_MOUNTINFO = "/proc/self/mountinfo"
_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, \ as \ooo


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def file_system_type(path: str | os.PathLike[str], mountinfo: str = _MOUNTINFO) -> str | None:
    """The type (``ext4``, ``tmpfs``, …) of the mount holding ``path`` (its longest mount point
    prefix), or None where ``mountinfo`` cannot be read (other systems)."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        pre, sep, post = line.partition(" - ")
        fields = pre.split()
        if not sep or len(fields) < 5 or not post.split():
            continue
        mount = _unescape(fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, post.split()[0]
    return kind


def memory_backed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on a memory file system (unknown: False)."""
    return file_system_type(Path(path)) in MEMORY_FS
