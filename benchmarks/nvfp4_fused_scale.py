"""NVFP4 dequantization error as vLLM loads it: per-tensor ``weight_scale_2`` against one shared
by each merged gate/up pair (issue #14 item 4).

vLLM keeps one global scale per merged module (vllm 0.23.0
``model_executor/layers/quantization/modelopt.py``): a linear (dense MLP, shared expert) takes
``weight_scale_2.max()`` of its shards (:1353-1368, W4A16_NVFP4), a FusedMoE expert takes
``w13_weight_scale_2[:, 0]``, w1's = the gate's (:1548-1556; w1 is ``gate_proj``,
``models/deepseek_v2.py:1379``), for both halves. Codes and block scales stay as stored.

For every gate/up pair of a source (dense MLP, shared expert, each routed expert, the MTP
layer's), both members are quantized with hetquant's ``nvfp4`` format two ways — ``before``:
each from its own absmax (hetquant before this change); ``after``: from the pair's joint absmax
(what ``convert`` does now, byte-identical to ModelOpt: ``benchmarks/modelopt_nvfp4.py``)
— and dequantized with the scale vLLM would use. Reported: relative Frobenius error
``‖W' − W‖ / ‖W‖`` against the exact BF16 source, per module; the mean over modules and the
worst module. The baseline is the same module dequantized with its own stored scale.

    python benchmarks/nvfp4_fused_scale.py [SOURCE ...]   # default: both embedded tiny models
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from _measure import open_sources

from hetquant.convert import SourceCheckpoint
from hetquant.formats import get_format

RESULTS = Path(__file__).parent / "results" / "nvfp4_fused_scale.json"
NVFP4 = get_format("nvfp4")


def rel_err(stored: dict[str, torch.Tensor], scale_2: torch.Tensor, w: torch.Tensor) -> float:
    """Relative Frobenius error of ``stored`` dequantized with per-tensor scale ``scale_2``."""
    deq = NVFP4.dequantize({**stored, "weight_scale_2": scale_2})
    ref = w.to(torch.float32)
    return float((deq - ref).norm() / ref.norm())


def pairs(src: SourceCheckpoint) -> list[tuple[str, str, str]]:
    """(kind, gate name, up name) of every merged gate/up pair, in model order."""
    fam, cfg = src.config.family, src.config
    out = []
    for layer in range(cfg.total_layers):
        for mlp in fam.mlps:
            experts = range(cfg.num_experts) if mlp.expert == "routed" else (None,)
            for e in experts:
                gate, up = fam.tensor(mlp.gate, layer, e), fam.tensor(mlp.up, layer, e)
                if gate in src.tensors and up in src.tensors:
                    out.append((mlp.expert or "dense", gate, up))
    return out


def vllm_scale(kind: str, gate: dict, up: dict) -> torch.Tensor:
    """The one scale vLLM keeps for a merged gate/up: w1's (the gate's) in a FusedMoE, the max
    of the shards' in a linear."""
    s = [gate["weight_scale_2"], up["weight_scale_2"]]
    return s[0] if kind == "routed" else torch.stack(s).max()


def measure(src: SourceCheckpoint) -> list[dict[str, object]]:
    rows = []
    for kind, gate, up in pairs(src):
        w = {n: src.dequantized(n) for n in (gate, up)}
        amax = {n: float(t.abs().amax()) for n, t in w.items()}
        joint = max(amax.values())
        before = {n: NVFP4.quantize(t, weight_amax=amax[n]) for n, t in w.items()}
        after = {n: NVFP4.quantize(t, weight_amax=joint) for n, t in w.items()}

        vllm = {k: vllm_scale(kind, q[gate], q[up]) for k, q in (("b", before), ("a", after))}
        for n in (gate, up):
            rows.append({
                "module": n.removesuffix(".weight"), "kind": kind,
                "before_own": rel_err(before[n], before[n]["weight_scale_2"], w[n]),
                "before_vllm": rel_err(before[n], vllm["b"], w[n]),
                "after_own": rel_err(after[n], after[n]["weight_scale_2"], w[n]),
                "after_vllm": rel_err(after[n], vllm["a"], w[n]),
            })  # fmt: skip
    return rows


def summary(rows: list[dict[str, object]]) -> dict[str, object]:
    keys = ("before_own", "before_vllm", "after_own", "after_vllm")
    worst = max(rows, key=lambda r: r["before_vllm"])  # type: ignore[arg-type,return-value]
    return {
        "modules": len(rows),
        "mean": {k: statistics.fmean(r[k] for r in rows) for k in keys},  # type: ignore[misc]
        "worst_before_vllm": worst,
        "max": {k: max(r[k] for r in rows) for k in keys},  # type: ignore[type-var]
    }


def main() -> None:
    results = {}
    for s, src in open_sources(__doc__.splitlines()[0]):
        res = summary(measure(src))
        results[s] = res
        m, w = res["mean"], res["worst_before_vllm"]
        print(f"{s}: {res['modules']} gate/up modules")
        print("  mean rel. error    own scale   vLLM's scale")
        print(f"  before (own amax)  {m['before_own']:.4f}      {m['before_vllm']:.4f}")
        print(f"  after (joint amax) {m['after_own']:.4f}      {m['after_vllm']:.4f}")
        print(
            f"  worst under vLLM before: {w['module']}: {w['before_own']:.4f} -> "
            f"{w['before_vllm']:.4f}; after: {w['after_own']:.4f} -> {w['after_vllm']:.4f}"
        )
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
