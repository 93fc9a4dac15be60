"""Accuracy of every recipe on the trained tiny model, against its FP8 reference.

Converts ``examples/tiny-deepseek-v3-trained`` with bf16, ascend-hybrid (per-channel and
``--cpu-group-size`` 64 / 32 CPU experts), ascend-w8a8, awq-w4a16, ct-w4a16, ascend-w4a8,
ascend-w4a16 and fp4 — the calibrating recipes round-to-nearest and AWQ-calibrated on
``calib.txt`` (training-split text), through the converter's own calibration targets
(``convert/engine/calibration.py``) — then scores each artifact on the held-out text (``heldout.txt``,
never trained or calibrated on) through the runtime's quantized ops (W8A8 activation
quantization included, the CPU expert pool's INT4 GEMV for the hybrid's experts): perplexity,
ΔPPL against the FP8 reference, mean KL(reference ‖ artifact) of next-token distributions, top-1
agreement.

``ascend-hybrid AWQ + GPTQ`` is ``--calib-data`` with ``--calib-gptq`` (GPTQ codes for the CPU
experts after their AWQ scale and clip, ``calib/gptq.py``); ``dense down BF16`` adds
``--keep-dense-down`` (the dense layers' MLP down_proj kept in BF16).

One row is an investigation, not a recipe: ``ascend-hybrid AWQ, W8A8 searched too`` calibrates
the hybrid with every quantized linear searched (its W8A8 attention, dense and shared MLPs with
``w8a8_dynamic``'s int8 weights as the quantizer), where the recipe searches the experts only.

    python benchmarks/accuracy.py [--device cpu] [--calib-device cuda] [--eval-samples 16]
                                  [--calib-samples 64] [--rows LABEL ... [--merge]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
from hetquant.convert import SourceCheckpoint, calibrate_for, convert, get_recipe, plan_for
from hetquant.runtime.serving.run import local_model

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "tiny-deepseek-v3-trained"
TEXTS = REPO / "examples" / "tiny-tools"
RESULTS = REPO / "benchmarks" / "results" / "accuracy.json"
CAL, ALL = {"calibrate": True}, {"calibrate": True, "search": None}
ROWS = [("bf16", "bf16", {}), ("ascend-hybrid RTN", "ascend-hybrid", {}),
        ("ascend-hybrid AWQ", "ascend-hybrid", CAL),
        ("ascend-hybrid AWQ + GPTQ", "ascend-hybrid", {"calib_gptq": True, **CAL}),
        ("ascend-hybrid AWQ, W8A8 searched too", "ascend-hybrid", ALL),
        ("ascend-hybrid AWQ + GPTQ, dense down BF16", "ascend-hybrid",
         {"calib_gptq": True, "keep_dense_down": True, **CAL}),
        ("hybrid g32 AWQ + GPTQ, dense down BF16", "ascend-hybrid",
         {"cpu_group_size": 32, "calib_gptq": True, "keep_dense_down": True, **CAL}),
        ("hybrid g64 RTN", "ascend-hybrid", {"cpu_group_size": 64}),
        ("hybrid g64 AWQ", "ascend-hybrid", {"cpu_group_size": 64, **CAL}),
        ("hybrid g32 RTN", "ascend-hybrid", {"cpu_group_size": 32}),
        ("hybrid g32 AWQ", "ascend-hybrid", {"cpu_group_size": 32, **CAL}),
        ("ascend-w8a8", "ascend-w8a8", {}),
        ("ascend-w8a8, dense down BF16", "ascend-w8a8", {"keep_dense_down": True}),
        ("awq-w4a16 RTN", "awq-w4a16", {}), ("awq-w4a16 AWQ", "awq-w4a16", CAL),
        ("fp4 (nvfp4 layout)", "fp4", {"fp4_layout": "nvfp4"}),
        ("ct-w4a16 RTN", "ct-w4a16", {}), ("ct-w4a16 AWQ", "ct-w4a16", CAL),
        ("ascend-w4a8 RTN", "ascend-w4a8", {}), ("ascend-w4a8 AWQ", "ascend-w4a8", CAL),
        ("ascend-w4a16 RTN", "ascend-w4a16", {}), ("ascend-w4a16 AWQ", "ascend-w4a16", CAL),
        ("ascend-w4a8 AWQ, dense down BF16", "ascend-w4a8", {"keep_dense_down": True, **CAL}),
        ("ascend-w4a16 AWQ, dense down BF16", "ascend-w4a16", {"keep_dense_down": True, **CAL})]  # fmt: skip
_NOT_OPTIONS = ("calibrate", "search")
# hidden 384 is not a multiple of the Ascend FP4 tile group (N % 256): the tiled layout refuses
# this model's down_proj; the canonical layout holds the same values (tiling is a lossless reorder).


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", help="evaluation (runtime forward + reference)")
    ap.add_argument("--calib-device", default=None, help="calibration (default: --device)")
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rows", nargs="*", help="labels of the rows to run (default: all)")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="with --rows: replace those rows in results/accuracy.json (same settings required)",
    )
    args = ap.parse_args()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "calib_device": args.calib_device or args.device, "torch": torch.__version__,
            "eval_tokens": [args.eval_samples, args.seq_len], "calib_tokens": [args.calib_samples, args.seq_len]}  # fmt: skip
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    eval_tokens = token_blocks([TEXTS / "heldout.txt"], tok, eos, args.eval_samples, args.seq_len)
    reference = reference_forward_from_source(src, device=args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, recipe, opts in ROWS:
            if args.rows and label not in args.rows:
                continue
            t = time.perf_counter()
            options = {k: v for k, v in opts.items() if k not in _NOT_OPTIONS}
            rec = get_recipe(recipe).with_options(options) if options else get_recipe(recipe)
            if "search" in opts:
                rec = dataclasses.replace(rec, search=opts["search"])
            cal = None
            if opts.get("calibrate"):
                plan = plan_for(src, rec, 1 << 40)
                cal = calibrate_for(
                    src, plan, TEXTS / "calib.txt", args.calib_samples, args.seq_len,
                    device=args.calib_device or args.device,
                )  # fmt: skip
            out = Path(tmp) / label.replace(" ", "_").replace(",", "")
            convert(src, out, rec, max_shard_size=1 << 40, calibration=cal)
            model = local_model(out, device="cuda" if args.device == "cuda" else "cpu")
            r = evaluate(per_sequence(model.forward), reference, eval_tokens)
            r = {k: float(r[k]) for k in ("ppl", "ref_ppl", "kl", "top1")}
            r["dppl_pct"] = 100 * (r["ppl"] - r["ref_ppl"]) / r["ref_ppl"]
            rows.append({"artifact": label, **r, "seconds": round(time.perf_counter() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
            if args.rows and args.merge:  # each row kept as soon as it is measured
                _write(*_merged(rows[-1:], meta))
    print(
        f"\nheld-out: {args.eval_samples} x {args.seq_len} tokens; FP8 reference ppl {rows[0]['ref_ppl']:.3f}"
    )
    print(f"{'artifact':<38} {'ppl':>8} {'ΔPPL %':>8} {'KL':>9} {'top-1':>7}")
    for r in rows:
        print(
            f"{r['artifact']:<38} {r['ppl']:>8.3f} {r['dppl_pct']:>+8.2f} {r['kl']:>9.5f} {r['top1']:>7.4f}"
        )
    if not args.rows:  # a subset: printed (and with --merge kept row by row), else the file
        _write(rows, meta)


def _write(rows: list[dict], meta: dict) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


def _merged(rows: list[dict], meta: dict) -> tuple[list[dict], dict]:
    """``rows`` put into results/accuracy.json in place of the rows of the same label, in
    ``ROWS`` order; refused unless the file was made with the same settings (device, torch,
    token counts). The meta says which rows were rerun when (``rerun``)."""
    doc = json.loads(RESULTS.read_text())
    same = ("device", "calib_device", "torch", "eval_tokens", "calib_tokens")
    if any(doc["meta"].get(k) != meta[k] for k in same):
        raise SystemExit(f"--merge: {RESULTS} was made with other settings: {doc['meta']}")
    by_label = {r["artifact"]: r for r in doc["rows"]} | {r["artifact"]: r for r in rows}
    order = [label for label, _, _ in ROWS if label in by_label]
    rerun = {**doc["meta"].get("rerun", {}), **{r["artifact"]: meta["date"] for r in rows}}
    return [by_label[label] for label in order], {**doc["meta"], "rerun": rerun}


if __name__ == "__main__":
    main()
