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

from ..planning.plan import JobKind, Plan, SourceItem
from ..recipes import Target

__all__ = ["CALIB_OPTIONS", "calibrate_for", "calibration_record", "calibration_targets"]

log = logging.getLogger("hetquant")
CALIB_OPTIONS = {"group_size": "group_size", "calib_gptq": "gptq"}  # recipe option → AwqOptions


def calibration_targets(plan: Plan) -> tuple[dict[str, Any], set[str]]:
    """(linear weight name → ``calib.quantizer.Quantizer`` of its target, names searched)."""
    from hetquant.calib.quantizer import quantizer_of

    targets: dict[str, Any] = {}
    searched: set[str] = set()
    for job in plan.jobs:
        if job.kind is JobKind.COPY:
            continue
        for name in job.sources:
            item = plan.item(name)
            what = plan.recipe.calibration(item.role)
            if what is None:
                continue
            if _kept_codes(item, job.target):
                raise HetquantError(
                    f"{name}: repacked losslessly from the source's {item.fmt} codes into "
                    f"{job.target.name}; calibration would rescale it and re-quantize: drop "
                    "--calib-data (the source's experts are kept as trained)"
                )
            targets[name] = quantizer_of(job.target.fmt)
            if what == "search":
                searched.add(name)
    return targets, searched


def _kept_codes(item: SourceItem, target: Target) -> bool:
    """Whether the plan carries ``item``'s stored codes into ``target`` as they are (an expert
    repack, or a linear repack whose target holds the source's variant: ``jobs._linear``)."""
    if (item.fmt, target.name) in EXPERT_REPACKS:
        return True
    repack = LINEAR_REPACKS.get((item.fmt, target.name))
    if repack is None:
        return False
    src = get_format(item.fmt, **dict(item.params))
    return repack.holds(src, target.fmt) is None


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


def calibration_record(calibration: Any) -> dict[str, Any]:
    """What the manifest says about calibration: deterministic fields only (no timings).
    ``options.quantizer``: the target format(s) of the calibrated linears (one name, or a list),
    left out when it is awq_w4a16 alone — the key that ct-w4a16's calibrated manifests (and their
    golden bytes) have carried since before the quantizer seam, and awq-w4a16's never did."""
    if calibration is None:
        return {"method": "rtn"}
    stats = calibration.stats
    options = _applied(calibration.options.to_dict())
    formats = sorted({calibration.quantizer(n).fmt.name for n in calibration.quantized})
    if formats != ["awq_w4a16"]:  # awq-w4a16's: unsaid, as in manifests made before others
        options["quantizer"] = formats[0] if len(formats) == 1 else formats
    return {
        "method": calibration.options.method,
        "tokens": stats["tokens"],
        "options": options,
        "fallback_experts": stats.get("fallback_experts", {}),
        "mtp": "rtn",  # the MTP layer has no forward to calibrate through
        "compute": _compute_record(stats["device"], stats["dtype"]),
    }


def _compute_record(device: str, dtype: str) -> dict[str, Any]:
    """Where calibration ran and whether another machine gets the same bytes: on the CPU in
    float64 every CPU does (``calib/awq.py``, "Reproducibility"); an accelerator's BF16 matmuls
    give other transforms (README, "Reproducible calibration": the measured difference)."""
    kind = device.split(":")[0]
    return {
        "device": kind,
        "dtype": dtype,
        "same_bytes_on_every_cpu": kind == "cpu" and dtype == "float64",
    }


_OFF_UNLESS = {"gptq": ("gptq", "gptq_damp", "gptq_act_order", "gptq_sequential"),
               "act_aware": ("act_aware",)}  # fmt: skip


def _applied(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the settings of a step that did not run (GPTQ, the W8A8-aware
    search when off): a manifest says what was done, and those made before the steps existed
    keep their bytes."""
    for switch, keys in _OFF_UNLESS.items():
        if not options.get(switch):
            options = {k: v for k, v in options.items() if k not in keys}
    return options
