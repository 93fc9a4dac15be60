"""Pieces: what a split of a module's weight does to each of its stored tensors, down to bytes.

The placement (``placement.py``) decides that a rank keeps ``[start, stop)`` of a module's
weight along ``out`` (dim 0) or ``in`` (dim 1); here each stored key follows it through its
format's ``shard_view`` / ``shard_axes`` (``formats/``): a ``Piece`` is a slice along one axis
of the key's row-major view, ``Piece.span`` the file bytes that slice occupies, and a
``TensorRead`` one stored tensor of a rank: those bytes and what they become.

An even split needs whole units of every stored key (an AWQ group, an 8-pack, an NVFP4 block or
Ascend tile, an FP8 block); anything else is refused, naming the unit. A plain tensor (norm,
embedding, BF16 copy) is its own unit-1 format.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from hetquant.formats.base import WeightFormat
from hetquant.formats.dtypes import itemsize
from hetquant.formats.errors import HetquantError
from hetquant.formats.safetensors_io import HeaderEntry

__all__ = ["DIM_NAMES", "IN", "OUT", "ModuleInfo", "Piece", "Span", "TensorRead", "shard_pieces"]

OUT, IN = 0, 1
DIM_NAMES = ("out", "in")


@dataclass(frozen=True)
class ModuleInfo:
    """A stored module: format (None: one plain tensor), weight shape [out, in] (plain: the
    tensor's shape) and its tensors, local key → (file, header entry)."""

    prefix: str
    fmt: WeightFormat | None
    shape: tuple[int, ...]
    entries: Mapping[str, tuple[str, HeaderEntry]]


@dataclass(frozen=True)
class Span:
    """Bytes ``[start + i·stride, start + i·stride + run)`` of a file, for ``i < count``."""

    start: int
    run: int
    stride: int
    count: int = 1

    @property
    def nbytes(self) -> int:
        return self.run * self.count

    def ranges(self) -> Iterator[tuple[int, int]]:
        """The absolute ``[begin, end)`` byte ranges; a contiguous span is a single range."""
        for i in range(self.count):
            yield self.start + i * self.stride, self.start + i * self.stride + self.run


@dataclass(frozen=True)
class Piece:
    """What a rank keeps of one stored tensor: ``view[axis][start:stop]``, reshaped to ``shape``
    (axis None: the whole tensor)."""

    view: tuple[int, ...]
    axis: int | None
    start: int
    stop: int
    shape: tuple[int, ...]

    def span(self, entry: HeaderEntry) -> Span:
        """The file bytes of this piece of the stored tensor ``entry``."""
        if self.axis is None:
            return Span(entry.start, entry.nbytes, entry.nbytes)
        v, a = self.view, self.axis
        inner = math.prod(v[a + 1 :]) * itemsize(entry.dtype)  # bytes per entry along the axis
        run, stride, outer = (self.stop - self.start) * inner, v[a] * inner, math.prod(v[:a])
        start = entry.start + self.start * inner
        if outer == 1 or run == stride:
            return Span(start, run * outer, run * outer)
        return Span(start, run, stride, outer)


@dataclass(frozen=True)
class TensorRead:
    """One stored tensor of this rank: where its bytes are and what they become."""

    name: str
    module: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    span: Span
    bounds: tuple[tuple[int, int], tuple[int, int]] | None  # (out, in) ranges when split

    @property
    def nbytes(self) -> int:
        return self.span.nbytes


def _axes(info: ModuleInfo) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple]]:
    if info.fmt is None:
        (key,) = info.entries
        axes = tuple(d if d < len(info.shape) else None for d in (OUT, IN))
        return {key: info.shape}, {key: axes}
    return info.fmt.shard_view(info.shape), info.fmt.shard_axes(info.shape)  # type: ignore[arg-type]


def shard_pieces(info: ModuleInfo, dim: int | None, start: int, stop: int) -> dict[str, Piece]:
    """Each stored key's piece when the weight keeps ``[start, stop)`` along ``dim``.

    Raises HetquantError when that range cuts a unit (group, pack, block, tile) of some key.
    """
    views, axes = _axes(info)
    if dim is None:
        return {k: Piece(v, None, 0, 0, info.entries[k][1].shape) for k, v in views.items()}
    ranges = {}
    for key, view in views.items():
        axis = axes[key][dim]
        if axis is not None:
            unit = _unit(info, key, view[axis], dim)
            if start % unit or stop % unit:
                name, what = info.fmt.name if info.fmt else "plain", ("rows", "columns")[dim]
                raise HetquantError(
                    f"{info.prefix} ({name}, [out, in] = {list(info.shape)}): {DIM_NAMES[dim]} = "
                    f"{info.shape[dim]} leaves {stop - start} per rank, not a multiple of {unit} "
                    f"({key}: one entry per {unit} {what}); the split would cut a quantization unit"
                )
            ranges[key] = (axis, start // unit, stop // unit)
    shard = list(info.shape)
    shard[dim] = stop - start  # the shard's own [out, in]
    if info.fmt is None:
        finals = {k: tuple(shard) for k in views}
    else:
        finals = {k: m.shape for k, m in info.fmt.stored(tuple(shard)).items()}  # type: ignore[arg-type]
    return {k: Piece(v, *ranges.get(k, (None, 0, 0)), finals[k]) for k, v in views.items()}


def _unit(info: ModuleInfo, key: str, entries: int, dim: int) -> int:
    size = info.shape[dim]
    if entries == 0 or size % entries:
        raise HetquantError(
            f"{info.prefix}: stored {key} has {entries} entries along the weight's "
            f"{DIM_NAMES[dim]} ({size}); padded blocks cannot be split — keep it whole"
        )
    return size // entries
