"""vLLM's weight loading of an Ascend artifact at each TP rank, ported offline (headers only):
the second half of ``vllm_ascend_port`` (whose docstring lists the sources), step 4 — name mapping
(``models/deepseek_v2.py:1344-1560``) and the linear / FusedMoE weight loaders
(``layers/linear.py:362-380, 530-565, 689-860, 1493-1528``; ``layers/fused_moe/layer.py:592-803,
849-1140``), with the stricter checks that docstring names."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from vllm_ascend_port import Module, Param, model_params, plain_params, read_description

__all__ = ["checkpoint_metas", "load_moe", "load_report"]

# a parameter of lower rank rounds what copy_ puts in it: F32 scales on disk into BF16 params
# (w8a8_dynamic.py:65-73); integers never go into floats or back
PRECISION = {"F32": 3, "BF16": 2, "F16": 2, "I64": 1, "I32": 1, "I8": 0}
INTS = {"I64", "I32", "I8"}

STACKED = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
           ("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)]  # fmt: skip
EXPERT_SHARDS = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}


def checkpoint_metas(root: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every root tensor (index + headers): name → (dtype, shape)."""
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(root / file, "pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def _narrow(shape: tuple[int, ...], dim: int, start: int, size: int) -> tuple[int, ...]:
    if start + size > shape[dim]:
        raise RuntimeError(f"narrow: start ({start}) + length ({size}) exceeds dimension size")
    return (*shape[:dim], size, *shape[dim + 1 :])


def _exact(loaded: tuple[int, ...], dim: int, total: int) -> None:
    if loaded[dim] != total:
        raise AssertionError(f"ranks' slices cover {total} of dim {dim} of {list(loaded)}")


def _load_linear(mod: Module, p: Param, loaded: tuple, shard: int | None, tp: int, r: int) -> None:
    """Column / merged / replicated / row weight loaders (their narrow + shape assert)."""
    parts = 1 if mod.tp_kind == "replicated" else tp
    rank = r if parts > 1 else 0
    if mod.tp_kind == "row":
        want = p.shape
        if p.kind == "weight":  # input_dim 1
            _exact(loaded, 1, tp * p.shape[1])
            loaded = _narrow(loaded, 1, rank * p.shape[1], p.shape[1])
    elif shard is None and mod.tp_kind == "replicated":
        want = p.shape
    else:
        i = shard or 0
        size = mod.shards[i][1] // parts
        want = (size, *p.shape[1:])  # the param's slice at the shard's offset
        _exact(loaded, 0, parts * size)
        loaded = _narrow(loaded, 0, rank * size, size)
    if loaded != want:
        raise AssertionError(f"param_data.shape {list(want)} != loaded_weight.shape {list(loaded)}")


def load_moe(p: Param, loaded: tuple, sid: str, tp: int, r: int) -> None:
    """``FusedMoE.weight_loader`` for one expert's tensor (per-expert slice of the param)."""
    ed = p.shape[1:]
    if p.kind == "single" or (p.kind == "channel" and sid == "w2"):
        want = ed
    elif sid == "w2":  # _load_w2: shard_dim 1
        _exact(loaded, 1, tp * ed[1])
        loaded, want = _narrow(loaded, 1, r * (loaded[1] // tp), loaded[1] // tp), ed
    else:  # _load_w13: shard_dim 0, w1 then w3 halves
        half = ed[0] // 2
        _exact(loaded, 0, tp * half)
        loaded, want = _narrow(loaded, 0, r * (loaded[0] // tp), loaded[0] // tp), (half, *ed[1:])
    if loaded != want:
        raise AssertionError(f"expert_data {list(want)} != loaded_weight {list(loaded)}")


def _route(name: str, params: dict) -> tuple[str, object]:
    """vLLM's parameter for checkpoint tensor ``name`` and the shard (index, or (expert, id))."""
    for param_name, weight_name, shard in STACKED:
        if weight_name not in name or ("mlp.experts." in name and name not in params):
            continue
        mapped = name.replace(weight_name, param_name)
        if param_name == "fused_qkv_a_proj" and mapped not in params:
            continue
        return mapped, shard
    head, sep, tail = name.partition("mlp.experts.")
    if sep:
        expert, proj, suffix = tail.split(".", 2)
        w, sid = EXPERT_SHARDS[proj]
        return f"{head}mlp.experts.{w}_{suffix}", (int(expert), sid)
    return name, None


def load_report(root: Path, tp: int = 1) -> tuple[list[str], list[str]]:
    """(problems, tensors whose dtype the parameter rounds) of loading ``root`` at TP ``tp``."""
    cfg = json.loads((root / "config.json").read_text())
    desc = read_description(root)
    try:
        params, _ = model_params(cfg, desc, tp)
    except (KeyError, ValueError, NotImplementedError, AssertionError) as e:
        return [f"model construction: {type(e).__name__}: {e}"], []
    plain, problems, rounded = plain_params(cfg), [], []
    want = {(n, s) for n, (m, p) in params.items() if m.layer == "linear" and not p.synthesized
            for s in range(len(m.shards))}  # fmt: skip
    want |= {(n, (e, sid)) for n, (m, p) in params.items() if m.layer == "moe" and not p.synthesized
             for e in range(cfg["n_routed_experts"])
             for sid in (("w2",) if n.rpartition(".")[2].startswith("w2") else ("w1", "w3"))}  # fmt: skip
    filled = set()
    for name, (dtype, shape) in checkpoint_metas(root).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and int(layer) >= cfg["num_hidden_layers"]:
            continue  # the MTP layer: skipped by the main model (deepseek_v2.py:1398-1400)
        try:
            if name in plain:
                have = plain[name]
                if (dtype, shape) != have:
                    raise AssertionError(f"{dtype}{list(shape)} != param {have[0]}{list(have[1])}")
                continue
            mapped, shard = _route(name, params)
            mod, p = params[mapped]  # KeyError, as in deepseek_v2.py load_weights
            for r in range(tp):
                if mod.layer == "moe":
                    load_moe(p, shape, shard[1], tp, r)  # type: ignore[index]
                else:
                    _load_linear(mod, p, shape, shard, tp, r)  # type: ignore[arg-type]
            filled.add((mapped, 0 if shard is None else shard))
            if (dtype in INTS) != (p.dtype in INTS) or PRECISION[dtype] < PRECISION[p.dtype]:
                raise AssertionError(f"stored {dtype}, parameter {p.dtype}")
            if PRECISION[dtype] > PRECISION[p.dtype]:
                rounded.append(name)
        except (KeyError, AssertionError, RuntimeError) as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
    problems += [f"{n} {s}: declared, never loaded" for n, s in sorted(want - filled, key=str)]
    return problems, rounded
