"""How SGLang 0.5.23 on Ascend would pick and load the routed experts of an artifact, ported
offline from its source (paths relative to ``sglang/srt``; our code):

- ``quant_model_description.json`` is found by name and read as a ``modelslim`` config without
  any flag (``configs/model_config.py:1824-1836``);
- each FusedMoE's schemes come from expert 0's ``gate_proj`` / ``up_proj`` (must agree) and
  ``down_proj`` entries; missing entries raise ValueError ("Missing ModelSlim MoE quantization
  description"), a type without a MoE scheme (W4A16: there is none) raises ValueError
  (``layers/quantization/modelslim/modelslim.py:334-436``);
- W8A8_DYNAMIC and W4A8_DYNAMIC MoE parameters (``modelslim/schemes/modelslim_w8a8_int8_moe.py``
  :59-93, ``modelslim_w4a8_int8_moe.py:54-140``: always the packed int4 layout, per channel, F32
  scales, ``scale_bias`` [E, 2I, 1] / [E, H, 16/tp]); every one of them is loaded as a CHANNEL
  parameter (``layers/moe/fused_moe_triton/layer.py:1485-1501``): w1/w3 narrowed per rank, w2
  copied whole (:769-787) — so a [H, 16] ``scale_bias`` fits ``w2_scale_bias`` only at MoE TP 1.

Linears are not ported: SGLang resolves fused names through its own packed-module mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_ascend_load import checkpoint_metas, load_moe
from vllm_ascend_port import Param, read_description

__all__ = ["moe_report"]

MOE_SCHEMES = (
    "W4A4_MXFP4",
    "W4A8_MXFP",
    "W4A4_DYNAMIC",
    "W4A8_DYNAMIC",
    "W8A8_DYNAMIC",
    "W8A8_MXFP8",
)  # fmt: skip  modelslim.py:337-344
SHARDS = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}


def moe_schemes(desc: dict, prefix: str) -> tuple[str, str]:
    """``get_moe_scheme`` for the FusedMoE at ``prefix`` (``model.layers.L.mlp.experts``)."""
    w13 = {desc[k] for k in (f"{prefix}.0.gate_proj.weight", f"{prefix}.0.up_proj.weight")
           if k in desc}  # fmt: skip
    w2 = desc.get(f"{prefix}.0.down_proj.weight")
    if not w13 or w2 is None:
        raise ValueError(f"Missing ModelSlim MoE quantization description for layer {prefix}")
    if len(w13) > 1:
        raise ValueError(f"Mismatched ModelSlim quantization for W13 in layer {prefix}")
    (w13_name,) = w13
    if w13_name not in MOE_SCHEMES or w2 not in MOE_SCHEMES:
        raise ValueError(
            f"Unsupported ModelSlim MoE schemes for layer {prefix}: W13='{w13_name}', W2='{w2}'"
        )
    return w13_name, w2


def _params(scheme: str, group: str, e: int, h: int, i: int, tp: int) -> dict[str, Param]:
    """One weight group's parameters (``i``: intermediate size per partition)."""
    w4 = scheme == "W4A8_DYNAMIC"
    if group == "w13":
        out, inp, rows, bias = (i if w4 else 2 * i), h, 2 * i, 1
    else:
        out, inp, rows, bias = (h // 2 if w4 else h), i, h, 16 // tp
    p = {f"{group}_weight": Param("I8", (e, out, inp), "weight"),
         f"{group}_weight_scale": Param("F32", (e, rows, 1), "channel"),
         f"{group}_weight_offset": Param("F32", (e, rows, 1), "channel")}  # fmt: skip
    if w4:
        p[f"{group}_scale_bias"] = Param("F32", (e, rows, bias), "channel")
    return p


def moe_report(root: Path, tp: int = 1) -> list[str]:
    """Problems of loading ``root``'s routed experts in SGLang-NPU at MoE tensor parallel ``tp``."""
    cfg = json.loads((root / "config.json").read_text())
    desc = read_description(root)
    e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    params: dict[str, Param] = {}
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        try:
            w13, w2 = moe_schemes(desc, prefix)
        except ValueError as exc:
            return [f"model construction: ValueError: {exc}"]
        for group, scheme in (("w13", w13), ("w2", w2)):
            got = _params(scheme, group, e, h, i // tp, tp)
            params.update({f"{prefix}.{k}": v for k, v in got.items()})
    problems, filled = [], set()
    for name, (dtype, shape) in checkpoint_metas(root).items():
        head, sep, tail = name.partition(".experts.")
        if not sep or int(name.split(".")[2]) >= cfg["num_hidden_layers"]:
            continue
        expert, proj, suffix = tail.split(".", 2)
        group, sid = SHARDS[proj]
        mapped = f"{head}.experts.{group}_{suffix}"
        try:
            p = params[mapped]
            for r in range(tp):
                load_moe(p, shape, sid, tp, r)
            if dtype != p.dtype:
                raise AssertionError(f"stored {dtype}, parameter {p.dtype}")
            filled.add((mapped, int(expert), sid))
        except (KeyError, AssertionError, RuntimeError) as exc:
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    for mapped in params:
        for x in range(e):
            for sid in ("w2",) if ".experts.w2_" in mapped else ("w1", "w3"):
                if (mapped, x, sid) not in filled:
                    problems.append(f"{mapped} ({x}, {sid!r}): declared, never loaded")
    return problems
