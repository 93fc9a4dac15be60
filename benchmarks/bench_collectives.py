"""NCCL against gloo for ``hetquant run --device cuda``: load time, per-token time, logits.

For each recipe (default ``bf16`` and ``ascend-hybrid``) the embedded tiny model
(``examples/tiny-deepseek-v3``) is converted once into ``--work``. Then, interleaved round by
round (``--repeats``), ``run_artifact`` runs the same tokens with ``--generate`` greedy steps on
``--device cuda`` with ``--dist-backend gloo`` (the baseline) and ``nccl``, every run a fresh
rank process (world ``--tp``; at world 1 a named backend makes a one-rank group that carries
the collectives one rank makes — each MoE layer's expert sum and each next token's broadcast:
NCCL on the GPU's tensors, gloo through host copies). Each rank
reports (``RankTiming``): process-group set-up, load (``open_artifact`` until its tensors are on
its GPU through the pinned staging path and the CPU expert pool is open), and each forward step
(device synchronized). Per-token time = the median of the generated steps (each a full
re-prefill of the sequence so far: this reference forward has no KV cache); figures are medians
over rounds, the ratio is nccl / gloo.

Logits: nccl's against gloo's (max |Δ|, bit-identical or not) and against a CPU run of the same
artifact, bounded as ``tests/runtime/serving/test_run.py`` bounds a CUDA run against the CPU (bf16: the
order-of-sums bound ``_tol``; hybrid: 5% of the logit range, one int8 activation step).

``--cpu-dry-run``: no CUDA — both backends become gloo on the CPU (only proves the script runs).

Usage::

    python benchmarks/bench_collectives.py [--tp 1] [--repeats 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import machine_info, median, write_result  # noqa: E402

from hetquant.convert import SourceCheckpoint, convert, get_recipe  # noqa: E402
from hetquant.runtime.serving.run import RunSpec, run_artifact  # noqa: E402

TINY = HERE.parent / "examples" / "tiny-deepseek-v3"
TOKENS = (5, 17, 42, 100, 7, 300, 250, 11)
U = 2.0**-24
BACKENDS = ("gloo", "nccl")  # baseline first


def bound(recipe: str, cpu: np.ndarray) -> float:
    """The CUDA-vs-CPU bound of tests/runtime/serving/test_run.py for this recipe's logits."""
    if recipe != "bf16":
        return 0.05 * float(np.abs(cpu).max())
    c = SourceCheckpoint.open(TINY).config
    k_max = max(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.v_head_dim)
    return 4 * 2 * c.num_hidden_layers * k_max * U * float(np.abs(cpu).max())


def one_run(path: Path, tp: int, generate: int, device: str, backend: str | None) -> dict:
    """One ``run_artifact`` call: logits, generated ids, wall time, the ranks' timings."""
    timings: list[dict[str, Any]] = []
    spec = RunSpec(str(path), TOKENS, tp=tp, device=device, generate=generate, dist_backend=backend)
    t0 = time.perf_counter()
    logits, generated = run_artifact(spec, timings=timings)
    wall = time.perf_counter() - t0
    steps = timings[0]["steps_s"]
    return {
        "logits": logits,
        "generated": generated,
        "wall_s": wall,
        "init_s": max(t["init_s"] for t in timings),
        "load_s": max(t["load_s"] for t in timings),
        "prefill_s": steps[0],
        "per_token_s": median(steps[1:]) if len(steps) > 1 else None,
        "devices": [t["device"] for t in timings],
    }


def bench_recipe(recipe: str, args: argparse.Namespace) -> dict[str, Any]:
    path = args.work / recipe
    if not (path / "hetquant.json").exists():
        convert(SourceCheckpoint.open(TINY), path, get_recipe(recipe), max_shard_size=1 << 40)
    device, backends = ("cpu", ("gloo", "gloo")) if args.cpu_dry_run else ("cuda", BACKENDS)
    cpu = one_run(path, 1, args.generate, "cpu", None)
    runs: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    for _ in range(args.repeats):
        for name, backend in zip(BACKENDS, backends, strict=True):
            runs[name].append(one_run(path, args.tp, args.generate, device, backend))
            print(f"{recipe} {name}: {_short(runs[name][-1])}", file=sys.stderr, flush=True)
    fig = {b: _medians(rs) for b, rs in runs.items()}
    gloo, nccl = runs["gloo"][-1], runs["nccl"][-1]
    lim = bound(recipe, cpu["logits"])
    return {
        "artifact": recipe,
        "backends": fig,
        "nccl_over_gloo": {
            k: fig["nccl"][k] / fig["gloo"][k]
            for k in ("load_s", "per_token_s", "prefill_s", "init_s", "wall_s")
            if fig["gloo"].get(k)
        },
        "nccl_vs_gloo_max_abs": float(np.abs(nccl["logits"] - gloo["logits"]).max()),
        "nccl_vs_gloo_bit_identical": bool(np.array_equal(nccl["logits"], gloo["logits"])),
        "nccl_vs_cpu_max_abs": float(np.abs(nccl["logits"] - cpu["logits"]).max()),
        "gloo_vs_cpu_max_abs": float(np.abs(gloo["logits"] - cpu["logits"]).max()),
        "cpu_bound": lim,
        "within_bound": bool(np.abs(nccl["logits"] - cpu["logits"]).max() <= lim),
        "same_greedy_tokens": nccl["generated"] == gloo["generated"] == cpu["generated"],
        "generated": {
            "cpu": cpu["generated"],
            "gloo": gloo["generated"],
            "nccl": nccl["generated"],
        },
        "devices": {b: runs[b][-1]["devices"] for b in BACKENDS},
    }


def _medians(rs: list[dict]) -> dict[str, Any]:
    keys = ("wall_s", "init_s", "load_s", "prefill_s", "per_token_s")
    out: dict[str, Any] = {k: median([r[k] for r in rs]) for k in keys if rs[0][k] is not None}
    out["all"] = [{k: r[k] for k in keys} for r in rs]
    return out


def _short(r: dict) -> str:
    per = r["per_token_s"]
    return (
        f"wall {r['wall_s']:.2f} s, init {r['init_s'] * 1e3:.1f} ms, load {r['load_s'] * 1e3:.1f} ms, "
        f"prefill {r['prefill_s'] * 1e3:.1f} ms, per token {per * 1e3 if per else 0:.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/hetquant-bench-collectives"))
    ap.add_argument("--recipes", nargs="+", default=["bf16", "ascend-hybrid"])
    ap.add_argument("--tp", type=int, default=1, help="ranks (one GPU each under nccl)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--generate", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--cpu-dry-run", action="store_true", help="no CUDA: gloo on the CPU twice")
    args = ap.parse_args()
    doc = {
        "machine": machine_info(),
        "gpu": _gpu(),
        "tp": args.tp,
        "tokens": len(TOKENS),
        "generate": args.generate,
        "repeats": args.repeats,
        "cpu_dry_run": args.cpu_dry_run,
        "artifacts": [bench_recipe(r, args) for r in args.recipes],
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json is not None:
        write_result(args.json, doc)


def _gpu() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "name": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }


if __name__ == "__main__":
    main()
