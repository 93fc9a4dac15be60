"""A weight format read as a conversion source: the defaults behind ``WeightFormat``'s
``source_rows`` / ``source_dequantized`` / ``source_absmax`` / ``source_absmax_array``
(``formats/base.py`` documents the contracts), the NaN/Inf checks every source reader applies,
and the chunking of a weight's rows into blocks of about ``SOURCE_CHUNK_BYTES``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ._lazy import torch
from ._quant_native import absmax, absmax_array
from .errors import HetquantError

if TYPE_CHECKING:
    import numpy as np

    from .base import WeightFormat

__all__ = [
    "SOURCE_CHUNK_BYTES",
    "all_finite",
    "check_finite",
    "default_source_absmax",
    "default_source_absmax_array",
    "default_source_dequantized",
    "default_source_rows",
    "float_row_step",
    "float_rows",
    "row_step",
]

SOURCE_CHUNK_BYTES = 8 << 20  # BF16 bytes of one streamed source chunk


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``: one NaN-propagating absmax, ~20x cheaper than ``isfinite().all()``
    (the fused kernel where it applies: no ``|t|`` temporary)."""
    if t.numel() == 0:
        return True
    amax = absmax(t)
    return math.isfinite(float(t.abs().amax()) if amax is None else amax)


def check_finite(name: str, t: torch.Tensor, what: str = "source") -> None:
    """Refuse NaN/Inf in float tensor ``t`` (the count only computed to report it)."""
    if t.is_floating_point() and t.element_size() > 1 and not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise HetquantError(
            f"{name}: {bad} NaN/Inf value(s) in the {what}; the checkpoint is corrupt"
        )


def float_row_step(inp: int, itemsize: int) -> int:
    """Rows of a float weight [out, ``inp``] in one chunk of about SOURCE_CHUNK_BYTES."""
    return max(1, SOURCE_CHUNK_BYTES // max(1, inp * itemsize))


def float_rows(name: str, w: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """A float weight [out, in] as stored, checked, in chunks of about SOURCE_CHUNK_BYTES."""
    out, inp = w.shape
    step = float_row_step(inp, w.element_size())
    for r in range(0, out, step):
        check_finite(name, w[r : r + step])
        yield r, w[r : r + step]


def row_step(fmt: WeightFormat, shape: tuple[int, int]) -> tuple[int, frozenset[str]]:
    """(rows per source chunk, keys sliced by rows): chunks where every stored tensor holds one
    entry per weight row on dim 0 or none per row; otherwise one chunk of all rows."""
    whole = (shape[0], frozenset())
    try:
        axes = fmt.shard_axes(shape)
    except NotImplementedError:
        return whole
    stored = fmt.stored(shape)
    if fmt.shard_view(shape) != {k: m.shape for k, m in stored.items()}:
        return whole
    rows = frozenset(k for k, ax in axes.items() if ax[0] is not None)
    if any(axes[k][0] != 0 or stored[k].shape[0] != shape[0] for k in rows):
        return whole
    return max(1, SOURCE_CHUNK_BYTES // (2 * shape[1])), rows


def default_source_rows(
    fmt: WeightFormat, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
) -> Iterator[tuple[int, torch.Tensor]]:
    """``WeightFormat.source_rows``' default: row slices of every tensor made whole by
    ``shard_fixup`` where :func:`row_step` allows chunks, else the whole weight at once."""
    n, k = shape
    step, row_keys = row_step(fmt, shape)
    for r in range(0, n, step):
        part = tensors
        if step < n:
            part = {key: t[r : r + step] if key in row_keys else t for key, t in tensors.items()}
            part = fmt.shard_fixup(part, (r, min(r + step, n)), (0, k))
        try:
            rows = fmt.dequantize(part).to(torch.bfloat16)  # (r, in)
        except HetquantError as e:
            raise HetquantError(f"{name}: {e}") from None
        check_finite(name, rows, "dequantized weight")
        yield r, rows


def default_source_dequantized(
    fmt: WeightFormat, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
) -> torch.Tensor:
    """``WeightFormat.source_dequantized``' default: ``fmt.source_rows``' chunks copied into one
    BF16 [out, in] (no copy when there is one chunk)."""
    out: torch.Tensor | None = None
    for r, rows in fmt.source_rows(name, tensors, shape):
        if r == 0 and rows.shape[0] == shape[0]:
            return rows  # one chunk: no copy
        if out is None:
            out = torch.empty(shape, dtype=rows.dtype, device=rows.device)
        out[r : r + rows.shape[0]].copy_(rows)
    assert out is not None, f"{name}: source_rows gave no rows of {list(shape)}"
    return out


def default_source_absmax(
    fmt: WeightFormat, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
) -> float:
    """``WeightFormat.source_absmax``' default: the largest ``|W|`` of ``fmt.source_rows``."""
    rows = fmt.source_rows(name, tensors, shape)
    return max((float(r.abs().amax()) for _, r in rows), default=0.0)


def default_source_absmax_array(
    fmt: WeightFormat, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int]
) -> float:
    """``WeightFormat.source_absmax_array``' default: the largest of ``fmt.source_row_arrays``'
    rows (validated, BF16 bits)."""
    best = 0.0
    for _, rows in fmt.source_row_arrays(name, arrays, shape):
        m = absmax_array(rows)
        assert m is not None, f"{name}: source_row_arrays gave {rows.dtype} rows"
        best = max(best, m)
    return best
