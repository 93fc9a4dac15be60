"""What an artifact tells its consumers besides the tensors: config.json and format files.

``artifact_metadata(plan, source_config)`` returns the root part's config.json and any extra JSON
files, from the formats the plan uses (a table, format → writer):

- Ascend (``w8a8_dynamic``, ``w8a8``, ``w4a8_dynamic``): ``quant_model_description.json``
  covering every stored root tensor — quantized modules by their quant type (W4A16 for
  ``ct_pack_quantized`` experts beside them), everything else ``FLOAT`` — as vllm-ascend
  ``--quantization ascend`` and MindIE read it, with the one ``group_size`` its W4A8 (0: per
  channel) or W4A16 (the group) scheme reads; ``quantization_config`` is removed from
  config.json, as msModelSlim's saver does (vllm-ascend otherwise sees "fp8"), and W4A8 models
  get msModelSlim's ``quantize`` / ``moe_quantize`` / ``mla_quantize`` (/ ``mtp_quantize``) keys.
  This description covers the whole root: no other writer runs beside it.
- AutoAWQ (``awq_w4a16``): config.json ``quantization_config`` with ``modules_to_not_convert``
  = the full module names of the linears left unquantized. Readers match these as *substrings*
  (AutoAWQ, vLLM), so a bare ``"gate"`` would also skip every ``gate_proj``; a full name such as
  ``model.layers.3.mlp.gate`` matches only the router.
- compressed-tensors (``ct_pack_quantized``): the ``quantization_config`` compressed-tensors
  writes for pack-quantized W4A16 (``CtPackQuantized.quantization_config``): one group,
  ``targets: ["Linear"]``, ``ignore`` = the full names of the linear-like modules kept at source
  precision (matched exactly by compressed-tensors, vLLM and vllm-ascend alike) and of the merged
  modules engines build from them (``fused_kept``: vLLM 0.32 otherwise quantizes Qwen3-MoE's dense
  ``gate_up_proj``), plus a top-level
  ``group_size``, which vllm-ascend's W4A16 MoE method reads from the config and takes as 32
  without it (``quantization/methods/w4a16.py:185``; compressed-tensors ignores it). Targets need
  no editing for vllm-ascend: it maps a ``Linear`` target onto ``FusedMoE`` layers
  (``compressed_tensors_config.py:97-106``), which it looks up as ``<experts>.0.gate_proj``
  (:181); every other linear is ignored, as it must be (vllm-ascend has no W4A16 linear).
- NVFP4 canonical (``nvfp4``): ModelOpt's ``hf_quant_config.json`` and the matching
  ``quantization_config``, with ``exclude_modules`` likewise.
- NVFP4 Ascend tiled (``nvfp4_ascend``): a ``quantization_config`` with ``quant_method:
  hetquant`` naming the layout, and no ``hf_quant_config.json`` — NVIDIA-side tools must not
  mistake tiled bytes for canonical NVFP4.
A dropped MTP layer sets the config's MTP layer count to 0 (``ModelConfig.without_mtp``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.families import parse_config
from hetquant.formats.nvfp4 import BLOCK, hf_quant_config
from hetquant.formats.w8a8_npu import QUANT_TYPE_FLOAT, description_entries, description_header

from .base import COPY, ROOT

__all__ = ["DESCRIPTION_NAME", "HF_QUANT_CONFIG_NAME", "artifact_metadata", "unconverted_modules"]

DESCRIPTION_NAME = "quant_model_description.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
_LINEAR_KINDS = {"linear", "router", "head"}


def unconverted_modules(plan: Any) -> list[str]:
    """Full names of the linear-like modules the plan keeps at source precision."""
    kept = []
    for job in plan.jobs:
        item = plan.item(job.source)
        linear_like = item.role.role.kind in _LINEAR_KINDS
        if (
            linear_like
            and item.name.endswith(".weight")
            and (job.kind == COPY or job.target.name == "bf16")
        ):
            kept.append(item.name.removesuffix(".weight"))
    return kept


def fused_kept(plan: Any, kept: list[str]) -> list[str]:
    """Full names of the merged modules engines build (vLLM's packed modules: ``gate_up_proj``,
    ``qkv_proj``, ``fused_qkv_a_proj``; the role table's ``fused``) whose every part is in
    ``kept``. vLLM matches a merged layer's own name before its parts', and sees its parts only
    through the model's ``packed_modules_mapping``, which for Qwen3-MoE lacks the dense layers'
    ``gate_up_proj`` when the quantization config reads it (``qwen3_moe.py:576`` adds it in
    ``__init__``, after ``SupportsQuant.__new__`` (``interfaces.py:1259``) copied the mapping):
    listing the merged name is what makes it skip that layer."""
    parts: dict[str, set[str]] = {}
    for job in plan.jobs:
        item = plan.item(job.source)
        fused = item.role.role.fused
        if fused and item.role.role.kind in _LINEAR_KINDS and item.name.endswith(".weight"):
            module = item.name.removesuffix(".weight")
            parts.setdefault(f"{module.rpartition('.')[0]}.{fused}", set()).add(module)
    return [name for name, ps in parts.items() if ps <= set(kept)]


def _ascend(plan: Any, cfg: dict[str, Any], files: dict[str, Any]) -> None:
    doc: dict[str, Any] = {}
    for job in plan.jobs:
        if job.target.part != ROOT:
            continue
        if job.kind == COPY:
            doc[job.source] = QUANT_TYPE_FLOAT
        else:
            keys = [p.key for p in job.outputs]
            prefix = job.source.removesuffix(".weight")
            doc.update(description_entries(prefix, job.target.name, keys))
    doc.update(description_header())  # after the entries, as msModelSlim writes them
    doc["group_size"] = _description_group(plan)  # the header's slot: 0 unless a 4-bit scheme
    cfg.pop("quantization_config", None)
    if any(j.target.name == "w4a8_dynamic" for j in plan.jobs) and (
        cfg.get("model_type") in _W4A8_CONFIG_KEYS_FOR
    ):
        cfg.update(_w4a8_config_keys(plan))
    files[DESCRIPTION_NAME] = doc


# the description's one ``group_size``, as each Ascend scheme reads it (vllm-ascend 0.23.0.post1
# methods/w4a8.py:351-353: 0 = per channel, absent = 256; methods/w4a16.py:185: absent = 32)
_DESCRIPTION_GROUP: dict[str, Callable[[Any], int]] = {
    "w4a8_dynamic": lambda fmt: 0,
    "ct_pack_quantized": lambda fmt: fmt.group_size,
}


def _description_group(plan: Any) -> int:
    groups = {
        _DESCRIPTION_GROUP[j.target.name](j.target.fmt): j.source
        for j in plan.jobs
        if j.target.part == ROOT and j.target.name in _DESCRIPTION_GROUP
    }
    if len(groups) > 1:
        raise HetquantError(
            f"quant_model_description.json has one group_size, but the root needs "
            f"{sorted(groups)} ({', '.join(groups.values())}); use one group size"
        )
    return next(iter(groups), 0)


# the model types whose msModelSlim 26.1.0 adapters add W4A8 config keys (others add none)
_W4A8_CONFIG_KEYS_FOR = frozenset({"deepseek_v3", "kimi_k2"})


def _w4a8_config_keys(plan: Any) -> dict[str, str]:
    """config.json keys msModelSlim adds to W4A8 models "as MindIE requires" (26.1.0
    ``model/deepseek_v3/model_adapter.py:530-563``; ``model/kimi_k2/model_adapter.py:297-330``,
    K2 having no MTP layer, leaves ``mtp_quantize`` out): written when MTP layers are kept."""
    keys = {"mtp_quantize": "w8a8_dynamic"}
    if not any(plan.item(j.source).role.mtp for j in plan.jobs):
        keys = {}
    keys.update(quantize="w8a8_dynamic", moe_quantize="w4a8_dynamic", mla_quantize="w8a8_dynamic")
    return keys


def _awq(plan: Any, cfg: dict[str, Any], files: dict[str, Any]) -> None:
    fmt = next(j.target.fmt for j in plan.jobs if j.target.name == "awq_w4a16")
    cfg["quantization_config"] = fmt.quantization_config(unconverted_modules(plan) or None)


def _ct(plan: Any, cfg: dict[str, Any], files: dict[str, Any]) -> None:
    fmt = next(j.target.fmt for j in plan.jobs if j.target.name == "ct_pack_quantized")
    kept = unconverted_modules(plan)
    ignore = sorted({*kept, *fused_kept(plan, kept)})
    qc = fmt.quantization_config(ignore=ignore)  # reads the group size alone
    cfg["quantization_config"] = {**qc, "group_size": fmt.group_size}


def _nvfp4(plan: Any, cfg: dict[str, Any], files: dict[str, Any]) -> None:
    hf, qc = hf_quant_config(unconverted_modules(plan))
    files[HF_QUANT_CONFIG_NAME] = hf
    cfg["quantization_config"] = qc


def _nvfp4_ascend(plan: Any, cfg: dict[str, Any], files: dict[str, Any]) -> None:
    cfg["quantization_config"] = {
        "quant_method": "hetquant",
        "format": "nvfp4_ascend",
        "layout": "ascend 8x8 FP4 tiles, weight [K, N/2], weight_scale E4M3 [K/16, N]",
        "group_size": BLOCK,
        "exclude_modules": sorted(set(unconverted_modules(plan))),
    }


_WRITERS: dict[str, Callable[[Any, dict[str, Any], dict[str, Any]], None]] = {
    "w8a8_dynamic": _ascend,
    "w8a8": _ascend,
    "w4a8_dynamic": _ascend,
    "awq_w4a16": _awq,
    "ct_pack_quantized": _ct,
    "nvfp4": _nvfp4,
    "nvfp4_ascend": _nvfp4_ascend,
}


def artifact_metadata(
    plan: Any, source_config: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json of the root part, {extra file name: JSON document})."""
    cfg = copy.deepcopy(source_config)
    cfg.pop("quantization_config", None)  # the source's FP8 block config no longer applies
    if isinstance(cfg.get("text_config"), dict):  # a VLM's text decoder may carry it (Kimi K2.5)
        cfg["text_config"].pop("quantization_config", None)
    if any(i.role.mtp for i in plan.items) and not any(
        plan.item(j.source).role.mtp for j in plan.jobs
    ):
        cfg = parse_config(source_config).without_mtp(cfg)
    files: dict[str, Any] = {}
    writers = {
        _WRITERS[j.target.name]
        for j in plan.jobs
        if j.target.part == ROOT and j.target.name in _WRITERS
    }
    if _ascend in writers:  # its description covers every root module (W4A16 experts included)
        writers = {_ascend}
    for writer in sorted(writers, key=lambda w: w.__name__):
        writer(plan, cfg, files)
    return cfg, files
