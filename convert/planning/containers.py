"""Containers: the file layouts an artifact is written in (the writer seam).

A container is one output file of a size fixed at plan time: ``header`` bytes, then its tensors
(named byte ranges) back to back. The plan knows every container's layout before any data
exists, so the engine can create each file at its final size, let any worker process write a
job's bytes at their fixed offsets (``writer.PieceWriter``), in any order, idempotently, and hash
each file as it fills (``hashing``).
Everything around that — plan, journal, resume, manifest sha256, ``hetquant verify`` — is
container-agnostic; a container only says how its file starts and how to check it:

- ``safetensors``: the root part's shards and the stacked expert files. ``header`` is the
  safetensors length prefix and JSON header (``formats.safetensors_io.build_header``).
- ``raw``: a headerless blob, its tensors' bytes concatenated in order — the shape of other
  engines' per-expert files (kt-kernel's ``_layer_L/_numa_N/*.kt`` hold exactly one packed
  buffer each and are checked by exact size; /work/shared/reference/cpu_experts.md §1.2). Its
  layout lives only in the plan (and so in the manifest's recipe, from which verify replays it).

A recipe picks a container per target (``Target.container``, default ``safetensors``); a new
engine's layout is one more class in ``CONTAINERS``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hetquant.formats import HetquantError, TensorMeta
from hetquant.formats.safe_paths import open_binary
from hetquant.formats.safetensors_io import build_header, read_header

from ..fs.os_errors import naming

__all__ = [
    "CONTAINERS",
    "Container",
    "OutTensor",
    "RawFile",
    "SafetensorsFile",
    "allocate",
    "make_container",
]

SAFETENSORS = "safetensors"
HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class OutTensor:
    name: str
    meta: TensorMeta


@dataclass
class Container:
    """One output file: ``header`` bytes, then ``tensors`` in data order (see module docstring)."""

    kind: ClassVar[str]
    name: str  # path relative to OUTPUT
    part: str
    tensors: list[OutTensor] = field(default_factory=list)

    @property
    def header(self) -> bytes:
        """The bytes the file starts with (written when it is created)."""
        raise NotImplementedError

    @property
    def data_size(self) -> int:
        return sum(t.meta.nbytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size

    def offsets(self) -> dict[str, int]:
        """Absolute file offset of every tensor's first byte."""
        pos, out = len(self.header), {}
        for t in self.tensors:
            out[t.name] = pos
            pos += t.meta.nbytes
        return out

    def layout_digest(self) -> str:
        """What the plan digest records of this file: its header, or its layout if it has none."""
        return hashlib.sha256(self.header).hexdigest()

    def create(self, path: Path) -> None:
        """Create ``path`` at its final size, ``header`` first, space reserved where possible."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with naming(path), open(path, "wb") as fh:  # EFBIG (ulimit -f) from allocate: no path
            fh.write(self.header)
            fh.flush()
            allocate(fh.fileno(), self.size)

    def intact(self, path: Path) -> bool:
        """Whether ``path`` has this layout's size and header (its jobs' bytes can be trusted)."""
        try:
            if path.stat().st_size != self.size:
                return False
            with open_binary(path) as fh:
                return fh.read(len(self.header)) == self.header
        except FileNotFoundError:
            return False

    def check(self, path: Path) -> list[str]:
        """Problems with the finished file at ``path`` (``hetquant verify``); empty if none."""
        if not self.intact(path):
            return [f"{self.name}: size or header differs from the plan ({self.kind}, {self.size} bytes)"]  # fmt: skip
        return []


@dataclass
class SafetensorsFile(Container):
    kind: ClassVar[str] = SAFETENSORS

    @property
    def header(self) -> bytes:
        return build_header(((t.name, t.meta) for t in self.tensors), HEADER_METADATA)

    def check(self, path: Path) -> list[str]:
        try:
            read_header(path)
        except HetquantError as e:
            return [str(e)]
        with open_binary(path) as fh:
            if fh.read(len(self.header)) != self.header:
                return [f"{self.name}: header differs from the plan (tensor names, dtypes or shapes)"]  # fmt: skip
        return []


@dataclass
class RawFile(Container):
    kind: ClassVar[str] = "raw"

    @property
    def header(self) -> bytes:
        return b""

    def layout_digest(self) -> str:
        doc = [self.kind] + [[t.name, t.meta.dtype, list(t.meta.shape)] for t in self.tensors]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


CONTAINERS: dict[str, type[Container]] = {c.kind: c for c in (SafetensorsFile, RawFile)}


def make_container(kind: str, name: str, part: str) -> Container:
    """An empty container of registered ``kind`` (tensors are added by the plan)."""
    try:
        return CONTAINERS[kind](name, part)
    except KeyError:
        raise HetquantError(
            f"{name}: unknown container {kind!r}; known: {', '.join(sorted(CONTAINERS))}"
        ) from None


# space reservation -------------------------------------------------------------------------------
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_FALLOCATE = getattr(_LIBC, "fallocate", None)
if _FALLOCATE is not None:
    _FALLOCATE.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _FALLOCATE.restype = ctypes.c_int
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


_FSTATFS = getattr(_LIBC, "fstatfs", None)
_TMPFS_MAGIC = 0x01021994
if _FSTATFS is not None:
    _FSTATFS.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _in_memory(fd: int) -> bool:
    """Whether ``fd`` is on tmpfs (Linux ``fstatfs``: ``f_type``, the struct's first word)."""
    if _FSTATFS is None or not sys.platform.startswith("linux"):
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _FSTATFS(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value == _TMPFS_MAGIC


def allocate(fd: int, size: int) -> None:
    """Size the file of ``fd`` to ``size`` bytes, reserving its blocks where the filesystem can.

    Linux ``fallocate(2)`` (mode 0: the file reads as zeros, blocks are reserved, so a full disk
    shows up now rather than in the middle of the jobs); where it is unsupported, a sparse
    ``ftruncate``. Not ``posix_fallocate``: glibc emulates that by writing every block. Not on
    tmpfs either: there it zero-fills every page in this one process (1.7 GB/s measured, seconds
    of serial work before any job for a large artifact) that the jobs then overwrite; the space
    check before the jobs covers it.
    """
    if size and _FALLOCATE is not None and not _in_memory(fd) and _FALLOCATE(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)
