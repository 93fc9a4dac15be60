"""AWQ options on the trained tiny model: which calibration beats round-to-nearest.

Same setting as ``accuracy.py`` (held-out text through the runtime), one awq-w4a16 artifact per
option set; prints ΔPPL and KL for each, RTN first.

    python benchmarks/awq_sweep.py [--device cpu] [--calib-device cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hetquant.calib.calibrate import AwqOptions, calibrate
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.runtime.serving.run import local_model

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "tiny-deepseek-v3-trained"
TEXTS = REPO / "examples" / "tiny-tools"
VARIANTS = {
    "rtn": None,
    "awq (default)": {},
    "awq propagate=float": {"propagate": "float"},
    "awq no clip": {"clip": False},
    "awq no duo": {"duo_scaling": False},
    "awq grid 40": {"grid": 40},
    "awq no o_proj fold": {"fold_o_proj": False},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calib-device", default=None)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--calib-samples", type=int, default=40)
    args = ap.parse_args()
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    ev = token_blocks([TEXTS / "heldout.txt"], tok, eos, args.eval_samples, 512)
    ca = token_blocks([TEXTS / "calib.txt"], tok, eos, args.calib_samples, 512)
    ref = reference_forward_from_source(src, device=args.device)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, opts in VARIANTS.items():
            cal = (
                None
                if opts is None
                else calibrate(src, ca, AwqOptions(**opts), device=args.calib_device or args.device)
            )
            d = Path(tmp) / name.replace(" ", "_")
            convert(src, d, get_recipe("awq-w4a16"), max_shard_size=1 << 40, calibration=cal)
            r = evaluate(per_sequence(local_model(d).forward), ref, ev)
            out[name] = {
                "dppl_pct": 100 * (float(r["ppl"]) / float(r["ref_ppl"]) - 1),
                "kl": float(r["kl"]),
                "top1": float(r["top1"]),
            }
            print(json.dumps({name: out[name]}), flush=True)
    (REPO / "benchmarks" / "results" / "awq_sweep.json").write_text(
        json.dumps(out, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
