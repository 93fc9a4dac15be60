"""``--calib-data``: what a recipe calibrates, from its plan, and the calibration run itself.

The plan says which format every linear is written in; each linear the recipe quantizes
(``Recipe.calibration``) is calibrated with that format — its ``Target`` format and parameters —
as the quantizer (``calib/quantizer.py``), and those the recipe searches get their AWQ scales
and clips. A linear repacked losslessly from the source's own low-bit codes (Kimi K2 Thinking's
INT4 experts, into the CPU expert layout or into ``ct_pack_quantized`` of the same group) cannot
take a calibration's column scales: such a plan is refused before anything is read or written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError, get_format
from hetquant.formats.expert_repack import EXPERT_REPACKS
from hetquant.formats.linear_repack import LINEAR_REPACKS

from .planning.plan import Plan, SourceItem
from .recipes import COPY, Target

__all__ = ["CALIB_OPTIONS", "calibrate_for", "calibration_targets"]

log = logging.getLogger("hetquant")
CALIB_OPTIONS = {"group_size": "group_size", "calib_gptq": "gptq"}  # recipe option → AwqOptions


def calibration_targets(plan: Plan) -> tuple[dict[str, Any], set[str]]:
    """(linear weight name → ``calib.quantizer.Quantizer`` of its target, names searched)."""
    from hetquant.calib.quantizer import quantizer_for

    targets: dict[str, Any] = {}
    searched: set[str] = set()
    for job in plan.jobs:
        if job.kind == COPY:
            continue
        for name in job.sources:
            item = plan.item(name)
            what = plan.recipe.calibration(item.role)
            if what is None:
                continue
            if _kept_codes(item, job.target):
                raise HetquantError(
                    f"{name}: repacked losslessly from the source's {item.fmt} codes into "
                    f"{job.target.fmt}; calibration would rescale it and re-quantize: drop "
                    "--calib-data (the source's experts are kept as trained)"
                )
            targets[name] = quantizer_for(job.target.fmt, dict(job.target.params))
            if what == "search":
                searched.add(name)
    return targets, searched


def _kept_codes(item: SourceItem, target: Target) -> bool:
    """Whether the plan carries ``item``'s stored codes into ``target`` as they are (an expert
    repack, or a linear repack whose target holds the source's variant: ``jobs._linear``)."""
    if (item.fmt, target.fmt) in EXPERT_REPACKS:
        return True
    repack = LINEAR_REPACKS.get((item.fmt, target.fmt))
    if repack is None:
        return False
    src = get_format(item.fmt, **dict(item.params))
    return repack.holds(src, get_format(target.fmt, **dict(target.params))) is None


def calibrate_for(
    src: Any, plan: Plan, text: Path, samples: int, seq_len: int, *, device: Any = None
) -> Any:
    """AWQ calibration of ``src`` for ``plan`` on ``text`` (streaming, one layer at a time;
    ``device``: the compute device, default ``calib.forward.default_device()``)."""
    from hetquant.calib.calibrate import AwqOptions, calibrate
    from hetquant.calib.data import load_tokenizer, token_blocks

    recipe = plan.recipe
    targets, searched = calibration_targets(plan)
    tokenizer, eos = load_tokenizer(src.root)
    tokens = token_blocks([text], tokenizer, eos, samples, seq_len)
    log.info("calibrating on %d x %d tokens of %s", samples, seq_len, text)
    opts = {field: recipe.option(k) for k, field in CALIB_OPTIONS.items() if k in recipe.choices}
    return calibrate(
        src, tokens, AwqOptions(**opts), targets=targets, searched=searched, device=device,
        log=log.info,
    )  # fmt: skip
