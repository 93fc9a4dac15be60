"""Variants of the ascend-hybrid calibration on the trained tiny model, scored as
``benchmarks/accuracy.py`` scores its rows (held-out 16 × 512 tokens, the runtime's ops, CPU).

- ``floor``: the hybrid with its routed experts kept in BF16 (W8A8 everything else): what the
  W8A8 part alone costs, the KL no expert calibration can go below; with ``search=all`` its
  W8A8 linears calibrated (e.g. ``act_aware=True``: the W8A8-aware search of ``calib/smooth.py``);
- ``awq KEY=VALUE ...``: the hybrid calibrated on 40 × 512 tokens of ``calib.txt`` with
  ``AwqOptions`` overrides (e.g. ``clip_grid=50``: clip steps of 0.02 instead of 0.05;
  ``gptq=True``: GPTQ codes for the experts, ``gptq_sequential=True``: down's Hessian from the
  GPTQ-quantized gate and up, ``act_aware=True`` with ``search=all``: the W8A8 linears' balances
  scored with their per-token activation quantization), ``cpu=G`` for ``--cpu-group-size G``,
  ``search=all`` to search every quantized linear (the recipe: the routed experts),
  ``keep_dense_down=True`` for ``--keep-dense-down`` (the dense MLPs' down_proj in BF16).

benchmarks/README.md "Accuracy of the CPU experts" quotes what these printed.

    python benchmarks/archive/probes/hybrid_calibration.py floor
    python benchmarks/archive/probes/hybrid_calibration.py awq clip_grid=50
    python benchmarks/archive/probes/hybrid_calibration.py awq gptq=True
    python benchmarks/archive/probes/hybrid_calibration.py floor search=all act_aware=True
    python benchmarks/archive/probes/hybrid_calibration.py awq gptq=True act_aware=True search=all
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from hetquant.calib.calibrate import AwqOptions, calibrate
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
from hetquant.convert import SourceCheckpoint, calibration_targets, convert, get_recipe, plan_for
from hetquant.convert.recipes.quantized import KEEP
from hetquant.runtime.serving.run import local_model

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "examples" / "tiny-deepseek-v3-trained"
TEXTS = REPO / "examples" / "tiny-tools"


def main() -> None:
    mode, *args = sys.argv[1:]
    kv = dict(a.split("=", 1) for a in args)
    recipe_keys = ("cpu", "search", "keep_dense_down")
    over = {k: ast.literal_eval(v) for k, v in kv.items() if k not in recipe_keys}
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    held = token_blocks([TEXTS / "heldout.txt"], tok, eos, 16, 512)
    rec = get_recipe("ascend-hybrid")
    if "cpu" in kv:
        rec = rec.with_options({"cpu_group_size": int(kv["cpu"])})
    if kv.get("keep_dense_down") == "True":
        rec = rec.with_options({"keep_dense_down": True})
    if kv.get("search") == "all":
        rec = dataclasses.replace(rec, search=None)
    cal = None
    if mode == "floor":
        rec = dataclasses.replace(
            rec, name="hybrid-bf16-experts", rules={**rec.rules, "routed": KEEP}
        )
    if mode == "awq" or "search" in kv:
        targets, searched = calibration_targets(plan_for(src, rec, 1 << 40))
        tokens = token_blocks([TEXTS / "calib.txt"], tok, eos, 40, 512)
        opts = AwqOptions(**over)
        cal = calibrate(src, tokens, opts, targets=targets, searched=searched, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        convert(src, Path(tmp) / "a", rec, max_shard_size=1 << 40, calibration=cal)
        model = local_model(Path(tmp) / "a", device="cpu")
        r = evaluate(
            per_sequence(model.forward), reference_forward_from_source(src, device="cpu"), held
        )
    out = {k: float(r[k]) for k in ("ppl", "ref_ppl", "kl", "top1")}
    out["dppl_pct"] = 100 * (out["ppl"] - out["ref_ppl"]) / out["ref_ppl"]
    print(json.dumps({"mode": mode, **kv, **out}))


if __name__ == "__main__":
    main()
