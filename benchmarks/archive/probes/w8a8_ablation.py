"""Where the ascend-hybrid's W8A8 part loses its KL: the floor (routed experts BF16, every other
quantized linear W8A8_DYNAMIC, ``hybrid_calibration.py floor``) with one class of linears W8A8 at a
time, and the whole set weights-only (int8 weights, float activations) or activations-only
(per-token int8 activations, float weights). Scored as ``benchmarks/accuracy.py`` scores its rows:
16 × 512 held-out tokens, the FP8 reference in float32, the runtime's ops on the CPU.

Each linear of the floor artifact runs one of: ``w8a8`` (the runtime's W8A8_DYNAMIC kernel, as
converted), ``bf16`` (the same linear of the bf16 artifact: the source's weight), ``w`` (the
int8 weight dequantized, float activations), ``a`` (``npu_dynamic_quant`` of the input
dequantized, the BF16 weight). The reference logits are computed once.

    python benchmarks/archive/probes/w8a8_ablation.py [VARIANT ...]   # default: all of VARIANTS
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
from hetquant.calib.smooth import dynamic_fake_quant
from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.convert.recipes.quantized import KEEP
from hetquant.runtime.serving.run import local_model

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "examples" / "tiny-deepseek-v3-trained"
TEXTS = REPO / "examples" / "tiny-tools"
RESULTS = REPO / "benchmarks" / "archive" / "results" / "w8a8_ablation.json"

CLASSES = {
    "q_a": ("self_attn.q_a_proj",),
    "q_b": ("self_attn.q_b_proj",),
    "kv_a": ("self_attn.kv_a_proj_with_mqa",),
    "o": ("self_attn.o_proj",),
    "dense_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "dense_down": ("mlp.down_proj",),
    "shared_gate_up": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    "shared_down": ("mlp.shared_experts.down_proj",),
}
VARIANTS = ["floor", "none", *[f"only:{c}" for c in CLASSES], "w_only", "a_only"]


def class_of(prefix: str) -> str | None:
    """The ablation class of module ``prefix`` (``model.layers.L.<suffix>``), or None."""
    suffix = prefix.split(".", 3)[3]
    return next((c for c, sfx in CLASSES.items() if suffix in sfx), None)


def plan_of(variant: str) -> Callable[[str], str]:
    """prefix → how that W8A8 linear runs (``w8a8`` / ``bf16`` / ``w`` / ``a``) in ``variant``;
    ``only:C`` keeps class C W8A8, ``only:C:w`` / ``only:C:a`` its weights / activations only,
    ``L<l>`` every W8A8 linear of layer l alone, ``except:C`` / ``except:L<l>`` every one but
    class C / layer l's."""
    if variant == "floor":
        return lambda p: "w8a8"
    if variant == "none":
        return lambda p: "bf16"
    if variant in ("w_only", "a_only"):
        return lambda p: variant[0]
    if variant.startswith("L"):
        return lambda p: "w8a8" if p.split(".")[2] == variant[1:] else "bf16"
    if variant.startswith("except:"):
        return lambda p: "bf16" if _named(p, variant.split(":")[1]) else "w8a8"
    _, cls, *how = variant.split(":")
    mode = how[0] if how else "w8a8"
    return lambda p: mode if class_of(p) == cls else "bf16"


def floor_recipe():
    """ascend-hybrid with its routed experts kept (BF16): ``hybrid_calibration.py floor``."""
    hyb = get_recipe("ascend-hybrid")
    return dataclasses.replace(hyb, name="floor", rules={**hyb.rules, "routed": KEEP})


def _named(prefix: str, what: str) -> bool:
    """Whether module ``prefix`` is of class ``what``, or in layer ``what`` (``L<l>``)."""
    return class_of(prefix) == what or f"L{prefix.split('.')[2]}" == what


def patched(floor, bf16, plan: Callable[[str], str]):
    """``floor``'s model with each W8A8 linear run as ``plan`` says (module docstring)."""
    fw, bw = floor.weights, bf16.weights
    orig = type(fw)._linear

    def linear(prefix: str):
        lin = orig(fw, prefix)
        if lin.fmt_name != "w8a8_dynamic":
            return lin
        how = plan(prefix)
        if how == "w8a8":
            return lin
        wf = orig(bw, prefix).kernel.prepared["weight"].to(torch.float32)  # source weight
        if how == "bf16":
            return lambda x: F.linear(x.float(), wf).to(x.dtype)
        if how == "a":
            return lambda x: F.linear(dynamic_fake_quant(x), wf).to(x.dtype)
        p = lin.kernel.prepared
        wq = p["weight"].to(torch.float32) * p["weight_scale"][:, None]
        return lambda x: F.linear(x.float(), wq).to(x.dtype)

    fw._linear = linear
    return floor


def main() -> None:
    variants = sys.argv[1:] or VARIANTS
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    held = token_blocks([TEXTS / "heldout.txt"], tok, eos, 16, 512)
    t0 = time.perf_counter()
    ref = reference_forward_from_source(src, device="cpu")(held)
    print(f"reference: {time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        convert(src, Path(tmp) / "floor", floor_recipe(), max_shard_size=1 << 40)
        convert(src, Path(tmp) / "bf16", get_recipe("bf16"), max_shard_size=1 << 40)
        for v in variants:
            t0 = time.perf_counter()
            floor = local_model(Path(tmp) / "floor", device="cpu")
            bf16 = local_model(Path(tmp) / "bf16", device="cpu")
            model = patched(floor, bf16, plan_of(v))
            r = evaluate(per_sequence(model.forward), lambda t: ref, held)
            out = {k: float(r[k]) for k in ("ppl", "ref_ppl", "kl", "top1")}
            out["dppl_pct"] = 100 * (out["ppl"] - out["ref_ppl"]) / out["ref_ppl"]
            rows.append({"variant": v, **out, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    doc = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    keep = [r for r in doc["rows"] if r["variant"] not in {x["variant"] for x in rows}]
    doc = {"meta": {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": "cpu",
                    "eval_tokens": [16, 512]}, "rows": keep + rows}  # fmt: skip
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
