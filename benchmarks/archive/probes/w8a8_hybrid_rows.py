"""The calibrated ascend-hybrid (``--calib-data --calib-gptq``: AWQ + GPTQ on the CPU INT4
experts, 40 × 512 tokens of ``calib.txt``) and its floor, with the remedies of
``w8a8_down_smooth.py`` for layer 0's dense down_proj, and the hybrid with W8A8 replaced by BF16
everywhere (routed experts INT4 per-channel, calibrated alike): the data point of the
infeasibility argument. Scored as ``accuracy.py`` (16 × 512 held-out tokens, FP8 reference).

Variants of one artifact:
- ``as-is``: the artifact as converted;
- ``down0-bf16``: layer 0's dense down_proj run in BF16 (the source weight; msModelSlim's
  ``FLOAT`` for one linear, which vllm-ascend serves unquantized) — patched in the runtime;
- ``down0-smooth``: the artifact converted with the smoothing scale of ``w8a8_down_smooth.py``'s
  end-to-end search (results/w8a8_down_smooth.json ``best``) folded into layer 0's up_proj rows
  and down_proj columns (a ``Transform`` in the ``CalibrationResult``: a real W8A8 artifact).

    python benchmarks/archive/probes/w8a8_hybrid_rows.py floor | hybrid | experts   [...] [cpu=32]

(``cpu=G``: the CPU experts group-wise, ``--cpu-group-size G``.)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hetquant.calib.calibrate import AwqOptions, CalibrationResult, Transform
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
from hetquant.convert import SourceCheckpoint, calibrate_for, convert, get_recipe, plan_for
from hetquant.convert.recipes.quantized import KEEP
from hetquant.runtime.serving.run import local_model

sys.path.insert(0, str(Path(__file__).parent))
from w8a8_ablation import MODEL, TEXTS, floor_recipe
from w8a8_down_smooth import RESULTS as SMOOTH
from w8a8_down_smooth import candidates, down_input

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "archive" / "results" / "w8a8_hybrid_rows.json"
MLP = "model.layers.0.mlp"


def hybrid_recipe(cpu: int | None = None):
    opts = {"calib_gptq": True} | ({"cpu_group_size": cpu} if cpu else {})
    return get_recipe("ascend-hybrid").with_options(opts)


def experts_recipe(cpu: int | None = None):
    """The hybrid with every W8A8 linear kept in BF16: only the routed experts quantized."""
    rec = hybrid_recipe(cpu)
    rules = {**rec.rules, "attention": KEEP, "dense": KEEP, "shared": KEEP}
    return dataclasses.replace(rec, name="experts-only", rules=rules)


def smoothing_scale(src, bf16_dir: Path, cal_tokens: torch.Tensor) -> tuple[str, torch.Tensor]:
    label = json.loads(SMOOTH.read_text())["search"]["best"]
    bf16 = local_model(bf16_dir, device="cpu")
    x = down_input(bf16, MLP, cal_tokens)
    down = bf16.weights._linear(f"{MLP}.down_proj").kernel.prepared["weight"].float()
    return label, dict(candidates(x, down))[label]


def with_smoothing(cal: CalibrationResult | None, s: torch.Tensor, tokens) -> CalibrationResult:
    up, down = f"{MLP}.up_proj.weight", f"{MLP}.down_proj.weight"
    tf = dict(cal.transforms) if cal is not None else {}
    if up in tf or down in tf:
        raise SystemExit(f"{MLP}: the calibration already transforms its up/down")
    tf[up], tf[down] = Transform(row_div=s), Transform(col_mul=s)
    if cal is None:
        stats = {"tokens": {"samples": tokens.shape[0], "seq_len": tokens.shape[1]}}
        return CalibrationResult(AwqOptions(method="rtn"), tf, (), stats)
    return CalibrationResult(cal.options, tf, cal.quantized, cal.stats, cal.weights_fn, cal.targets)


def down0_bf16(model, bf16_dir: Path):
    w, b = model.weights, local_model(bf16_dir, device="cpu").weights
    orig = type(w)._linear
    w._linear = lambda p: orig(b, p) if p == f"{MLP}.down_proj" else orig(w, p)
    return model


def score(model, ref, held) -> dict[str, float]:
    r = evaluate(per_sequence(model.forward), lambda t: ref, held)
    out = {k: float(r[k]) for k in ("ppl", "ref_ppl", "kl", "top1")}
    out["dppl_pct"] = 100 * (out["ppl"] - out["ref_ppl"]) / out["ref_ppl"]
    return out


def main() -> None:
    args = sys.argv[1:]
    cpu = next((int(a.split("=")[1]) for a in args if a.startswith("cpu=")), None)
    modes = [a for a in args if "=" not in a] or ["floor", "hybrid", "experts"]
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    held = token_blocks([TEXTS / "heldout.txt"], tok, eos, 16, 512)
    cal_tokens = token_blocks([TEXTS / "calib.txt"], tok, eos, 40, 512)
    ref = reference_forward_from_source(src, device="cpu")(held)
    rows = []

    def row(mode: str, variant: str, model, t0: float) -> None:
        rows.append({"mode": mode, "variant": variant, **score(model, ref, held),
                     "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        bf16_dir = Path(tmp) / "bf16"
        convert(src, bf16_dir, get_recipe("bf16"), max_shard_size=1 << 40)
        label, s = smoothing_scale(src, bf16_dir, cal_tokens)
        for mode in modes:
            t0 = time.perf_counter()
            if mode == "floor":
                rec = floor_recipe()
            else:
                rec = {"hybrid": hybrid_recipe, "experts": experts_recipe}[mode](cpu)
                mode += f" g{cpu}" if cpu else ""
            cal = None
            if mode != "floor":
                cal = calibrate_for(src, plan_for(src, rec, 1 << 40), TEXTS / "calib.txt", 40, 512,
                                    device="cpu")  # fmt: skip
            art = Path(tmp) / mode
            convert(src, art, rec, max_shard_size=1 << 40, calibration=cal)
            row(mode, "as-is", local_model(art, device="cpu"), t0)
            if mode.startswith("experts"):
                continue
            t0 = time.perf_counter()
            row(mode, "down0-bf16", down0_bf16(local_model(art, device="cpu"), bf16_dir), t0)
            t0 = time.perf_counter()
            smoothed = Path(tmp) / f"{mode}-smooth"
            convert(src, smoothed, rec, max_shard_size=1 << 40,
                    calibration=with_smoothing(cal, s, cal_tokens))  # fmt: skip
            row(mode, f"down0-smooth ({label})", local_model(smoothed, device="cpu"), t0)
    doc = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    done = {(r["mode"], r["variant"]) for r in rows}
    doc["rows"] = [r for r in doc["rows"] if (r["mode"], r["variant"]) not in done] + rows
    doc["meta"] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": "cpu",
                   "eval_tokens": [16, 512], "calib_tokens": [40, 512]}  # fmt: skip
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
