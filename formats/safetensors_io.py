"""Safetensors files read from headers and byte ranges, and written header-first.

File layout (https://github.com/huggingface/safetensors, "Format"): ``u64 little-endian N`` ·
``N bytes of JSON header`` (padded with spaces to a multiple of 8) · data. The header maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the start of the
data, plus an optional ``"__metadata__"`` of string → string.

Reading validates the header as the safetensors library does (``Metadata::validate``): at most
``MAX_JSON_BYTES`` of JSON (bounded nesting, ``json_io``), known dtypes, every entry's byte size
equal to its dtype × shape, and the entries, sorted by offset, tiling the data area exactly — no
overlap (two tensors sharing bytes), no gap, no byte past the end or left over. It maps tensors through a
private copy-on-write memory map, so source pages stay reclaimable page cache and the source file
is never written. Writing knows every tensor's dtype and shape in advance: the header is written
first, the file is sized, and tensors (or parts of them) are written at their offsets with
``pwrite`` — by any process, in any order, idempotently, which is what resumable multi-worker
conversion needs.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._lazy import torch
from .base import TensorMeta
from .dtypes import itemsize, numpy_dtype, torch_dtype
from .errors import HetquantError
from .json_io import MAX_JSON_BYTES, parse_json
from .safe_paths import open_binary

__all__ = [
    "HeaderEntry",
    "SafetensorsHeader",
    "array_view",
    "build_header",
    "byte_view",
    "create_file",
    "read_header",
    "tensor_view",
    "write_at",
]

_LEN = struct.Struct("<Q")
MAX_DIMS = 16  # no weight has this many dims (every artifact and source here: at most 3)
_MAX_HEADER = MAX_JSON_BYTES  # the safetensors library's own limit (100,000,000)
_ALIGN = 8


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header; ``start``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of the bytes ``[start, end)`` as stored (a view entry's differs from
        ``shape``: ``fused_experts.ExpertSlice``)."""
        return self.shape

    def pick(self, block: np.ndarray) -> np.ndarray:
        """The tensor from its stored ``block`` (a plain entry: the block itself)."""
        return block


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated header: entries in file order, metadata, sizes."""

    path: Path
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and validate the header of ``path``; touches no tensor data."""
    path = Path(path)
    with open_binary(path) as f:  # a regular file: a FIFO or device is refused, never read
        size = os.fstat(f.fileno()).st_size
        raw_len = f.read(_LEN.size)
        if len(raw_len) < _LEN.size:
            raise HetquantError(f"{path}: only {size} bytes, not a safetensors file (truncated?)")
        (n,) = _LEN.unpack(raw_len)
        if n > _MAX_HEADER or _LEN.size + n > size:  # n is the file's bytes: never shown
            raise HetquantError(
                f"{path}: header length (the first 8 bytes) does not fit the {size}-byte file; "
                "the file is truncated or not safetensors — re-download it"
            )
        raw = f.read(n)
    header = parse_json(raw, f"{path}: header")
    if not isinstance(header, dict):
        raise HetquantError(f"{path}: header is not a JSON object")
    data_start = _LEN.size + n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HetquantError(f"{path}: __metadata__ is not a map of strings; the header is corrupt")
    entries = [_entry(path, name, spec, data_start, size) for name, spec in header.items()]
    entries.sort(key=lambda e: (e.start, e.end))
    _check_tiling(path, entries, data_start, size)
    return SafetensorsHeader(path, {e.name: e for e in entries}, dict(metadata), data_start, size)


def _entry(path: Path, name: str, spec: object, data_start: int, size: int) -> HeaderEntry:
    try:
        dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]  # type: ignore[index]
        shape = tuple(shape)
    except (KeyError, TypeError, ValueError):
        shape = None
    if (
        shape is None
        or not isinstance(dtype, str)
        or len(shape) > MAX_DIMS
        or not all(_is_int(d) and 0 <= d < 2**63 for d in shape)
        or not (_is_int(begin) and _is_int(end))
    ):
        raise HetquantError(
            f"{path}: malformed header entry for tensor {name!r} (a dtype string, a shape of at "
            f"most {MAX_DIMS} dims each below 2**63, two integer data_offsets)"
        )
    try:
        want = math.prod(shape) * itemsize(dtype)
    except HetquantError as e:
        raise HetquantError(f"{path}: tensor {name!r}: {e}") from None
    if not (0 <= begin <= end) or end - begin != want:
        raise HetquantError(
            f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] but {dtype}{list(shape)} "
            f"needs {want} bytes; the header is corrupt"
        )
    if data_start + end > size:
        raise HetquantError(
            f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has only {size} "
            "bytes; the shard is truncated or its header offsets point past the end — re-download it"
        )
    return HeaderEntry(name, dtype, shape, data_start + begin, data_start + end)


def _check_tiling(path: Path, entries: list[HeaderEntry], data_start: int, size: int) -> None:
    """``entries`` (sorted by offset) cover the data area ``[data_start, size)`` exactly, each
    starting where the one before it ends: an overlap would let one tensor's bytes be read as
    another's, a gap or a tail hides bytes no tensor owns."""
    at, before = data_start, None
    for e in entries:
        if e.start != at:
            how = "overlaps" if e.start < at else f"leaves {e.start - at} bytes unowned after"
            raise HetquantError(
                f"{path}: tensor {e.name!r} (data_offsets from {e.start - data_start}) {how} "
                f"tensor {before!r} (ending at {at - data_start}); safetensors tensors must be "
                "contiguous, without overlaps or gaps: the header is corrupt — re-download the file"
            )
        at, before = e.end, e.name
    if at != size:
        raise HetquantError(
            f"{path}: the tensors end at byte {at} but the file has {size}: {size - at} bytes "
            "no tensor owns (safetensors files end with their last tensor); re-download the file"
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class MappedFile:
    """A private (copy-on-write) memory map of a whole file; the file itself is never written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open_binary(path) as f:
            size = os.fstat(f.fileno()).st_size
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.path = Path(path)

    def view(self, entry: HeaderEntry) -> torch.Tensor:
        return tensor_view(self._mm, entry)

    def array(self, entry: HeaderEntry) -> np.ndarray:
        return array_view(self._mm, entry)

    def advise_dontneed(self) -> None:
        """Tell the kernel the mapped pages may go (the bytes stay in the page cache)."""
        if self._mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)


def array_view(buf: mmap.mmap | None, entry: HeaderEntry) -> np.ndarray:
    """A zero-copy numpy array over ``entry``'s bytes in ``buf`` (copied only if misaligned, or
    where a view entry picks from its block: ``HeaderEntry.pick``),
    BF16 and FP8 as their bits (``dtypes.numpy_dtype``)."""
    dtype = numpy_dtype(entry.dtype)
    if entry.nbytes == 0 or buf is None:
        return np.empty(entry.shape, dtype=dtype)
    raw = np.frombuffer(buf, dtype=np.uint8, count=entry.end - entry.start, offset=entry.start)
    if entry.start % itemsize(entry.dtype):
        raw = raw.copy()
    return entry.pick(raw.view(dtype).reshape(entry.block_shape))


def tensor_view(buf: mmap.mmap | None, entry: HeaderEntry) -> torch.Tensor:
    """:func:`array_view` as a tensor of the entry's dtype (zero-copy)."""
    raw = torch.from_numpy(array_view(buf, entry).reshape(-1).view(np.uint8))
    return raw.view(torch_dtype(entry.dtype)).reshape(entry.shape)


def build_header(tensors: Iterable[tuple[str, TensorMeta]], metadata: dict[str, str]) -> bytes:
    """Header bytes (length prefix + padded JSON) for ``tensors`` laid out in the given order."""
    doc: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, meta in tensors:
        doc[name] = {
            "dtype": meta.dtype,
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + meta.nbytes],
        }
        offset += meta.nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(len(body) + _LEN.size) % _ALIGN)
    return _LEN.pack(len(body)) + body


def create_file(path: str | os.PathLike[str], header: bytes, data_size: int) -> None:
    """Create ``path`` holding ``header`` followed by ``data_size`` zero bytes (sparse)."""
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + data_size)


def byte_view(data: Any) -> memoryview:
    """The bytes of ``data`` (bytes-like, a numpy array or a CPU tensor) as a flat memoryview;
    no copy for bytes or a C-contiguous array or tensor."""
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).cast("B")
    return memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy())  # a tensor


def write_at(fd: int, offset: int, data: Any) -> None:
    """Write ``data`` (see :func:`byte_view`) at absolute ``offset`` of ``fd``."""
    view = byte_view(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
