"""Remedies for the W8A8 part's KL, which ``w8a8_ablation.py`` puts (almost) all in the per-token
int8 activations of layer 0's dense ``down_proj``: a smoothing scale ``s`` for that down_proj's
input, folded into ``up_proj``'s output rows (``silu(g)·(u/s)`` = the input divided by ``s``) and
``down_proj``'s columns (times ``s``), both W8A8_DYNAMIC as before (what vllm-ascend serves).

``s`` is chosen by an END-TO-END objective: mean KL(reference ‖ model) of next-token
distributions on the first ``SPLIT`` sequences of the calibration tokens (40 × 512 of
``calib.txt``; never the held-out text), the floor model (routed experts BF16) with the
candidate's up/down quantized as the converter would. Candidates: SmoothQuant's
``max|X_c|^α / max|W_c|^(1−α)`` and AWQ's ``mean|X_c|^α / mean|Ŵ_c|^(1−α)`` (normalised), α on a
grid of 0.1, identity first. The chosen scale is then written into real artifacts through a
``CalibrationResult`` (``convert(..., calibration=)``) and scored on the held-out text as
``accuracy.py`` does.

    python benchmarks/archive/probes/w8a8_down_smooth.py search [MLP_PREFIX]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hetquant.calib import awq
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
from hetquant.calib.smooth import smooth_candidates
from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats import get_format
from hetquant.runtime.kernels.ops import QuantLinear
from hetquant.runtime.serving.run import local_model

sys.path.insert(0, str(Path(__file__).parent))
from w8a8_ablation import MODEL, TEXTS, floor_recipe

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "archive" / "results" / "w8a8_down_smooth.json"
SPLIT = 8  # calibration sequences the objective is scored on
W8A8 = get_format("w8a8_dynamic")


def w8a8(w: torch.Tensor) -> QuantLinear:
    return QuantLinear.from_stored(
        "w8a8_dynamic", W8A8.quantize(w.to(torch.float32)), backend="cpu"
    )


def down_input(model, mlp: str, tokens: torch.Tensor) -> torch.Tensor:
    """The float input [N·T, I] of ``mlp``'s down_proj over ``tokens`` (the bf16 model)."""
    w = model.weights
    orig, xs = type(w)._linear, []

    def linear(prefix: str):
        lin = orig(w, prefix)
        if prefix == f"{mlp}.down_proj":
            return lambda x: (xs.append(x.detach().clone()), lin(x))[1]
        return lin

    w._linear = linear
    for row in tokens:
        model.forward(row)
    del w._linear
    return torch.cat(xs).to(torch.float32)


def candidates(
    x: torch.Tensor, down: torch.Tensor, grid: int = 10
) -> list[tuple[str, torch.Tensor]]:
    """(label, s [I]): identity, SmoothQuant's α grid, AWQ's α grid."""
    out = [("identity", torch.ones(x.shape[1]))]
    w_max = down.abs().amax(0)
    out += [(f"sq{a:.1f}", s) for a, s in smooth_candidates(x.abs().amax(0), w_max, grid)[1:]]
    x_mean = awq.activation_mean(x)
    w_mean = awq.weight_mean([down], [down.shape[1]])
    out += [(f"awq{a:.1f}", s) for a, s in awq.scale_candidates(x_mean, w_mean, grid)[1:]]
    return out


def with_scale(model, mlp: str, up: torch.Tensor, down: torch.Tensor, s: torch.Tensor):
    """``model`` whose ``mlp`` up/down run W8A8 from ``up / s`` (rows) and ``down · s``."""
    w = model.weights
    orig = type(w)._linear
    lins = {f"{mlp}.up_proj": w8a8(up / s[:, None]), f"{mlp}.down_proj": w8a8(down * s)}
    w._linear = lambda p: lins.get(p) or orig(w, p)
    return model


def score(model, ref: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    r = evaluate(per_sequence(model.forward), lambda t: ref, tokens)
    out = {k: float(r[k]) for k in ("ppl", "ref_ppl", "kl", "top1")}
    out["dppl_pct"] = 100 * (out["ppl"] - out["ref_ppl"]) / out["ref_ppl"]
    return out


def search(mlp: str) -> dict:
    src = SourceCheckpoint.open(MODEL)
    tok, eos = load_tokenizer(MODEL)
    cal = token_blocks([TEXTS / "calib.txt"], tok, eos, 40, 512)
    split = cal[:SPLIT]
    ref = reference_forward_from_source(src, device="cpu")(split)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        convert(src, Path(tmp) / "floor", floor_recipe(), max_shard_size=1 << 40)
        convert(src, Path(tmp) / "bf16", get_recipe("bf16"), max_shard_size=1 << 40)
        bf16 = local_model(Path(tmp) / "bf16", device="cpu")
        x = down_input(bf16, mlp, cal)  # every calibration token: the statistics
        up, down = (
            bf16.weights._linear(f"{mlp}.{p}_proj").kernel.prepared["weight"].float()
            for p in ("up", "down")
        )
        for label, s in candidates(x, down):
            t0 = time.perf_counter()
            model = with_scale(local_model(Path(tmp) / "floor", device="cpu"), mlp, up, down, s)
            rows.append({"candidate": label, **score(model, ref, split),
                         "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    best = min(rows, key=lambda r: r["kl"])
    return {"mlp": mlp, "split": [SPLIT, 512], "rows": rows, "best": best["candidate"]}


def main() -> None:
    mode, *rest = sys.argv[1:]
    mlp = rest[0] if rest else "model.layers.0.mlp"
    if mode == "search":
        doc = search(mlp)
        RESULTS.write_text(
            json.dumps({"date": time.strftime("%Y-%m-%d"), "search": doc}, indent=2) + "\n"
        )
        print("best:", doc["best"])


if __name__ == "__main__":
    main()
