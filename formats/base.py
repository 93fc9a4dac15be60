"""What every weight format provides, and the registry that maps names to formats.

A format turns one linear weight ``W`` of shape ``[out, in]`` (float, the dequantized source) into
a dict of stored tensors keyed by *local* names — relative to the module prefix, e.g. ``weight``,
``weight_scale`` — and back. ``stored(shape)`` gives the names, dtypes and shapes of those tensors
from the shape alone, so plans and loaders never touch data. Formats are frozen dataclasses: their
parameters (group size, …) are fields, and ``get_format("awq_w4a16", group_size=64)`` returns a
variant. Callers look formats up by name; nobody branches on a format's name.

Identity: each format declares the stored keys it always writes (``keys``) and those some of its
variants add (``optional_keys``), and ``from_stored(metas)`` — the exact inverse of ``stored`` —
gives back the variant and the weight shape from stored dtypes and shapes alone.
``identify.identify`` asks every registered format and returns the one match that covers the most
keys; the source reader, the loader and the runtime ops all recognise a module's format through it.

A format read as a conversion source (``source_rows`` and its kin) streams its dequantized rows;
their defaults, the NaN/Inf checks and the row chunking live in ``formats/source_rows.py``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ._lazy import torch

if TYPE_CHECKING:
    import numpy as np

    from .arrays import RowsInto
from .dtypes import itemsize
from .errors import HetquantError
from .source_rows import (
    all_finite,
    check_finite,
    default_source_absmax,
    default_source_absmax_array,
    default_source_dequantized,
    default_source_rows,
    float_row_step,
    float_rows,
)

__all__ = [
    "FORMATS",
    "Streaming",
    "TensorMeta",
    "WeightFormat",
    "all_finite",
    "check_finite",
    "float_row_step",
    "float_rows",
    "get_format",
    "register",
    "stored_metas",
]


@dataclass(frozen=True)
class TensorMeta:
    """dtype (safetensors string) and shape of one stored tensor."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class Streaming:
    """A format's contract for row-chunked quantization (see ``WeightFormat.streaming``).

    ``chunk_format.quantize(W[r0:r1], **opts)`` gives, for each stored key, the part of the final
    tensor along ``axes[key]`` (the dim that runs over weight rows) that rows ``r0:r1`` own, or
    the whole tensor when ``axes[key]`` is None (a value of the weight as a whole). With
    ``needs_amax`` the converter first computes the whole weight's absmax and passes it as
    ``weight_amax=`` (the joint absmax of the linears engines merge with it, so that they share
    the per-tensor scale it sets: ``convert/planning/plan.py``). ``finish``, when set, turns the assembled tensors into the stored ones
    (e.g. a tiling); without it, keys along dim 0 may be written as chunks arrive. ``place``,
    when set, is asked first to put a chunk's part of a key into the tensor being assembled,
    ``place(key, assembled, part, start)`` (``start``: its first entry along ``axes[key]``), in
    the stored layout itself (a tiling done chunk by chunk); it returns False for a key it
    leaves to the plain copy.
    """

    chunk_format: WeightFormat
    axes: dict[str, int | None]
    needs_amax: bool = False
    finish: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    place: Callable[[str, torch.Tensor, torch.Tensor, int], bool] | None = None


@dataclass(frozen=True)
class WeightFormat(ABC):
    """Base of every on-disk weight format (see the module docstring)."""

    name: ClassVar[str]
    keys: ClassVar[frozenset[str]]  # stored keys every variant writes
    optional_keys: ClassVar[frozenset[str]] = frozenset()  # keys only some variants write
    # declared capabilities (the native lane, ``formats/native.py``): a format that has one sets
    # its flag and overrides the method
    native_quantize: ClassVar[bool] = False  # ``quantize_array``
    native_into: ClassVar[bool] = False  # ``quantize_array_into`` (chunks into the assembled)
    native_source: ClassVar[bool] = False  # ``source_row_arrays``
    # ``quantize_array`` stores BF16 rows as given (key "weight", along the rows): a source
    # format's kernel may compute them in place in the output (``arrays.RowsInto``)
    stores_bf16_rows: ClassVar[bool] = False
    # keys whose rows ``quantize_array`` can compute straight into arrays it is lent (``into=``,
    # rows-major outputs; the conversion lends the output's mapped pages: no copy follows)
    quantizes_rows_into: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[WeightFormat, tuple[int, int]]:
        """The variant (parameters) and weight shape [out, in] whose ``stored`` is ``metas``.

        The inverse of :meth:`stored`, from dtypes and shapes alone. ``metas`` holds this
        format's ``keys`` and those of its ``optional_keys`` that are present; the caller
        (:func:`identify`) checks the answer by comparing ``stored(shape)`` with ``metas``, so an
        implementation may raise (HetquantError, KeyError, IndexError, ArithmeticError) or
        answer a variant that does not fit when ``metas`` did not come from this format.
        """

    @abstractmethod
    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        """Local name → dtype/shape of every stored tensor for a weight of ``shape`` [out, in].

        Raises HetquantError when the format cannot store that shape (e.g. ``in`` not divisible
        by the group size), naming the constraint.
        """

    @abstractmethod
    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        """Float weight [out, in] → stored tensors (local names). Pure: never mutates ``weight``."""

    @abstractmethod
    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Stored tensors → float32 weight [out, in]; the reference kernels are checked against."""

    def quantize_array(self, rows: np.ndarray, **options: Any) -> dict[str, np.ndarray]:
        """``quantize`` of BF16 rows [r, in] (numpy, uint16 bit patterns) without torch, in the
        compiled kernels; only where ``native_quantize`` (a format whose streaming plan
        ``needs_amax`` also takes ``weight_amax=``; one with ``quantizes_rows_into`` also
        ``into=``: {key: array of that key's rows for these rows}, computed in place and
        returned). Raises ``native.NotNative`` for an input the kernel does not take."""
        raise NotImplementedError(f"format {self.name!r} has no native quantize_array")

    def quantize_array_into(
        self, rows: np.ndarray, row0: int, out: dict[str, np.ndarray], **options: Any
    ) -> dict[str, np.ndarray]:
        """The native lane's ``quantize`` + placement of a streaming plan's chunk format: rows
        ``row0`` .. of the weight quantized straight into their places in ``out`` (every
        stored tensor along the weight's rows, whole and in the stored layout, where the plan's
        ``Streaming.place`` or plain copy would have put them); returns the
        values of the whole weight (keys whose axis is None). Only where ``native_into``;
        ``NotNative`` as :meth:`quantize_array`."""
        raise NotImplementedError(f"format {self.name!r} has no native quantize_array_into")

    def source_row_arrays(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int],
        into: RowsInto | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:  # fmt: skip
        """``source_rows`` over numpy arrays, without torch; only where ``native_source``. A
        format that computes its rows may compute them into ``into(r, n)``'s array where it
        gives one (``arrays.RowsInto``); the rows it yields are then that array."""
        raise NotImplementedError(f"format {self.name!r} has no native source_row_arrays")

    def source_absmax_array(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int]
    ) -> float:
        """``source_absmax`` over numpy arrays, without torch; only where ``native_source``.
        Default: the largest of :meth:`source_row_arrays`' rows (validated, BF16 bits)."""
        return default_source_absmax_array(self, name, arrays, shape)

    @property
    def params(self) -> dict[str, Any]:
        """This variant's parameters: ``get_format(self.name, **self.params) == self``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def streaming(self, shape: tuple[int, int]) -> Streaming | None:
        """How a converter may quantize a weight of ``shape`` a block of rows at a time.

        None (the default): the format needs the whole weight at once.
        """
        return None

    def source_rows(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """This format read as a conversion source: (first row, BF16 rows [r, in]) of the
        weight, validated and dequantized exactly (``bf16(dequantize)``), a block of rows at a
        time; ``name`` (the module prefix) names it in errors.

        Default: where every stored tensor has the weight's rows on dim 0 or no rows at all
        (``shard_axes``), chunks of about ``SOURCE_CHUNK_BYTES`` of BF16, each a row slice of
        every tensor made whole by ``shard_fixup``; otherwise the whole weight at once. A chunk
        holding NaN/Inf is refused.
        """
        yield from default_source_rows(self, name, tensors, shape)

    def source_dequantized(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> torch.Tensor:
        """The whole weight as :meth:`source_rows` gives it (BF16 [out, in], validated), on the
        device ``tensors`` are on; each chunk is copied into one output as it comes."""
        return default_source_dequantized(self, name, tensors, shape)

    def source_absmax(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> float:
        """``max |W|`` of the source weight as :meth:`source_rows` gives it."""
        return default_source_absmax(self, name, tensors, shape)

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        """How each stored tensor follows the weight's dims, for tensor-parallel slicing.

        For every stored key: (dim that runs along W's ``out`` rows, dim that runs along its
        ``in`` columns), dims of the tensor as :meth:`shard_view` shapes it; None where the
        tensor does not vary along that weight dim (a per-tensor scale, a per-row scale along
        ``in``). The unit of a dim is ``weight size / entries`` (e.g. 8 rows per packed word,
        ``g`` columns per group scale); a shard is legal only on whole units of every key, and
        a slice of each view along its dim, reshaped to ``stored(shard shape)``, is the shard.

        Raises NotImplementedError for a format that has no sharding rule.
        """
        raise NotImplementedError(f"format {self.name!r} does not define shard_axes")

    def shard_view(self, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Row-major view of each stored tensor in which :meth:`shard_axes` dims are meant.

        Default: the stored shapes. A layout whose shards are not plain slices (a tiling)
        names a finer view here in which every legal shard is one slice along one dim.
        """
        return {key: meta.shape for key, meta in self.stored(shape).items()}

    def shard_fixup(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_range: tuple[int, int],
        in_range: tuple[int, int],
    ) -> dict[str, torch.Tensor]:
        """A shard's sliced tensors → its stored tensors (default: unchanged).

        ``out_range`` / ``in_range`` are the ``[start, stop)`` of the weight's rows and columns
        the shard holds; formats that store a value of the shape itself rewrite it here.
        """
        return dict(tensors)

    def nbytes(self, shape: tuple[int, int]) -> int:
        """Bytes stored for a weight of ``shape``."""
        return sum(m.nbytes for m in self.stored(shape).values())

    def bits_per_weight(self, shape: tuple[int, int]) -> float:
        """Stored bits per weight element, scales and zeros included."""
        return 8 * self.nbytes(shape) / math.prod(shape)

    def check_stored(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """Raise unless ``tensors`` has exactly the names, dtypes and shapes ``stored`` promises."""
        want = self.stored(shape)
        if set(tensors) != set(want):
            raise HetquantError(
                f"{self.name}: stored tensors {sorted(tensors)} != expected {sorted(want)}"
            )
        have = stored_metas(tensors)
        for key, meta in want.items():
            if (got := have[key]) != meta:
                raise HetquantError(f"{self.name}: {key} is {got}, expected {meta}")


def stored_metas(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    """dtype (safetensors string) and shape of each tensor of ``tensors``."""
    from .dtypes import st_dtype

    return {k: TensorMeta(st_dtype(t.dtype), tuple(t.shape)) for k, t in tensors.items()}


FORMATS: dict[str, WeightFormat] = {}


def register(fmt: WeightFormat) -> WeightFormat:
    """Add a format instance (with its default parameters) to the registry under ``fmt.name``."""
    if fmt.name in FORMATS:
        raise RuntimeError(f"format {fmt.name!r} registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str, **params: Any) -> WeightFormat:
    """The registered format ``name``, with ``params`` replacing its default fields."""
    try:
        fmt = FORMATS[name]
    except KeyError:
        raise HetquantError(
            f"unknown format {name!r}; known formats: {', '.join(sorted(FORMATS))}"
        ) from None
    return dataclasses.replace(fmt, **params) if params else fmt
