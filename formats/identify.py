"""Recognising a module's format from its stored tensors' dtypes and shapes alone.

Every registered format declares the keys it always writes (``keys``) and those some variants add
(``optional_keys``), and ``from_stored`` — the exact inverse of ``stored`` — gives back the variant
and weight shape. :func:`identify` asks every format whose keys a module holds and keeps the one
exact fit that covers the most keys (``base.py`` says what a format provides).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .base import FORMATS, TensorMeta, WeightFormat
from .errors import HetquantError

__all__ = ["Identified", "identify", "missing_partners", "show_meta"]


@dataclass(frozen=True)
class Identified:
    """What :func:`identify` recognised: the format variant, weight shape and the keys it owns."""

    fmt: WeightFormat
    shape: tuple[int, int]
    keys: frozenset[str]


_NOT_THIS_FORMAT = (HetquantError, KeyError, IndexError, ArithmeticError, TypeError, ValueError)


def _match(fmt: WeightFormat, metas: Mapping[str, TensorMeta], name: str) -> Identified | str:
    """``fmt``'s reading of ``metas`` (the tensors of module ``name``), or why it does not fit."""
    keys = fmt.keys | (fmt.optional_keys & metas.keys())
    mine = {k: metas[k] for k in keys}
    try:
        variant, shape = fmt.from_stored(mine)
        want = variant.stored(shape)
    except _NOT_THIS_FORMAT as e:
        return f"{fmt.name}: {e}"
    if want != mine:
        diff = [
            f"{name}.{k} is {show_meta(mine.get(k))}, expected {show_meta(m)}"
            for k, m in want.items()
            if mine.get(k) != m
        ]
        return f"{fmt.name}: {', '.join(diff) or sorted(set(mine) - set(want))}"
    return Identified(variant, tuple(int(d) for d in shape), frozenset(keys))  # type: ignore[arg-type]


def show_meta(meta: TensorMeta | None) -> str:
    """``BF16[2, 2]`` (``missing`` for None): how messages show a stored tensor."""
    return "missing" if meta is None else f"{meta.dtype}{list(meta.shape)}"


def identify(
    metas: Mapping[str, TensorMeta],
    *,
    name: str = "module",
    prefer: Iterable[WeightFormat] = (),
) -> Identified | None:
    """The registered format whose stored tensors are among ``metas`` (one module's tensors,
    local names): of the formats that fit exactly, the one owning the most keys; keys it does
    not own are plain tensors of their own (a router's ``e_score_correction_bias``).

    None when no format fits. Raises HetquantError when the keys carry a quantized format's
    signature (more than one key; a lone ``weight`` also names norms and biases) but their dtypes
    or shapes fit none, or when two formats fit equally well; ``name`` prefixes the message.
    ``prefer``: variants whose parameters a format tries first where shapes leave them open
    (the source config's FP8 block edge).
    """
    fits: list[Identified] = []
    misfits: list[str] = []
    preferred = {f.name: f for f in prefer}
    for fmt in (preferred.get(key, f) for key, f in FORMATS.items()):
        if not fmt.keys <= metas.keys():
            continue
        got = _match(fmt, metas, name)
        if isinstance(got, Identified):
            fits.append(got)
        elif len(fmt.keys) > 1:
            misfits.append(got)
    if not fits:
        if misfits:
            raise HetquantError(
                f"{name}: stored tensors {sorted(metas)} fit no format ({'; '.join(misfits)})"
            )
        return None
    most = max(len(f.keys) for f in fits)
    best = [f for f in fits if len(f.keys) == most]
    if len(best) > 1:
        raise HetquantError(
            f"{name}: stored tensors {sorted(metas)} fit several formats "
            f"({', '.join(f.fmt.name for f in best)}); record the format in the manifest"
        )
    return best[0]


def missing_partners(metas: Mapping[str, TensorMeta], shape: tuple[int, int]) -> list[str]:
    """``"fmt (needs k, …)"`` for each format that would store ``metas`` as they are for a
    weight of ``shape``, and other tensors besides: what an incomplete module lacks."""
    out = []
    for fmt in FORMATS.values():
        if not metas.keys() <= fmt.keys | fmt.optional_keys:
            continue
        try:
            want = fmt.stored(shape)
        except _NOT_THIS_FORMAT:
            continue
        if want.keys() != metas.keys() and all(want.get(k) == m for k, m in metas.items()):
            out.append(f"{fmt.name} (needs {', '.join(sorted(want.keys() - metas.keys()))})")
    return out
