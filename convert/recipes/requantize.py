"""Low-bit sources: a source already stored in a low-bit format (INT4 codes and scales, e.g. Kimi
K2 Thinking's quantization-aware-trained experts) re-quantized to another low-bit format is
rounded a second time onto a grid it was not trained for, and a rule recipe refuses that unless
``requantize`` (``--requantize``) was asked for. A lossless repack (``formats/expert_repack.py``,
``formats/linear_repack.py``) keeps the codes and passes; a linear repack whose target parameters
do not hold the source's codes is refused the same way.

"Low-bit" is measured, not named: a format's stored bits per weight on ``PROBE_SHAPE``
(:func:`density`) under ``LOW_BITS``.
"""

from __future__ import annotations

import dataclasses
import functools

from hetquant.formats import EXPERT_FORMATS, FORMATS, ExpertLayerFormat, HetquantError
from hetquant.formats.expert_repack import EXPERT_REPACKS
from hetquant.formats.families import TensorRole
from hetquant.formats.linear_repack import LINEAR_REPACKS

from .base import Recipe, Target, Written
from .choices import Params

__all__ = ["LOW_BITS", "PROBE_SHAPE", "check_repack", "check_requantize", "density", "registered"]

LOW_BITS = 6.0  # stored bits per weight under which a format is a low-bit (4-bit-code) one
PROBE_SHAPE = (256, 1024)  # a weight every registered format stores, to measure its density


def check_requantize(recipe: Recipe, role: TensorRole, source_fmt: str, target: Target) -> None:
    """A low-bit source (INT4 codes and scales, e.g. Kimi K2 Thinking's QAT experts) written
    in another low-bit format is rounded a second time onto a grid it was not trained for:
    refused unless ``requantize`` was asked for."""
    if source_fmt == target.name or recipe.option("requantize"):
        return
    if (source_fmt, target.name) in EXPERT_REPACKS:  # codes and scales kept: no rounding
        return
    if (source_fmt, target.name) in LINEAR_REPACKS:  # kept where they fit: check_repack
        return
    src, dst = density(registered(source_fmt)), density(target.fmt)
    if src is None or dst is None or src >= LOW_BITS or dst >= LOW_BITS:
        return
    where = f"layer {role.layer}" + ("" if role.expert is None else f" expert {role.expert}")
    raise HetquantError(
        f"{role.role.name} ({where}): the source stores it in {source_fmt}, a low-bit "
        f"format; recipe {recipe.name} would re-quantize it to {target.name} "
        f"({dst:.2f} bits/weight), losing accuracy twice. Use --requantize to accept that, "
        "or a recipe that keeps it (bf16 dequantizes it exactly)"
    )


def check_repack(recipe: Recipe, target: Target, source_params: Params, source_fmt: str) -> None:
    """A linear repack target (``formats/linear_repack.py``) whose parameters do not hold the
    source's codes: refused unless ``requantize`` was asked for (the reason named)."""
    if recipe.option("requantize"):
        return
    src = dataclasses.replace(FORMATS[source_fmt], **dict(source_params))
    why = LINEAR_REPACKS[source_fmt, target.name].holds(src, target.fmt)
    if why is not None:
        raise HetquantError(
            f"recipe {recipe.name} cannot keep the source's {source_fmt} codes: {why}; "
            f"re-quantizing them loses accuracy twice. Choose the source's group "
            f"(--group-size {dict(source_params).get('group_size')}) to keep them, or "
            "--requantize to accept that"
        )


def registered(name: str) -> Written | None:
    """The registered format a source format's name names (None: ``plain``, not a format)."""
    return FORMATS.get(name) or EXPERT_FORMATS.get(name)


@functools.lru_cache(maxsize=256)
def density(fmt: Written | None) -> float | None:
    """Stored bits per weight of ``fmt`` on ``PROBE_SHAPE`` (None: not a format); a frozen
    format's, memoized (asked twice per tensor: DeepSeek-R1's plan asked 121,700 times)."""
    if isinstance(fmt, ExpertLayerFormat):
        inter, hidden = PROBE_SHAPE
        stored = fmt.stored(1, hidden, inter)
        return 8 * sum(m.nbytes for m in stored.values()) / (3 * inter * hidden)
    return None if fmt is None else fmt.bits_per_weight(PROBE_SHAPE)
