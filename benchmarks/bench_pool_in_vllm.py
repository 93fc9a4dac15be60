"""The CPU expert pool inside vLLM against the same pool called directly, one run, interleaved.

One real-shape DeepSeek-V3 MoE layer (256 experts, H 7168, I 2048, top-8; MLA attention at real
dims; ``make_synthetic.py --dense-layers 0``: one layer, a 1024-token vocabulary) converted with
``ascend-hybrid``, so its routed experts live in ``cpu_experts/`` (INT4 per channel) and vLLM's
``CpuPoolMoEMethod`` (``runtime/vllm/moe.py``) hands every routed-expert call to our
``CpuExpertPool``. vLLM (its CPU build) serves it in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy, ``--batches`` prompts at a time.

Inside: the wall time of each ``CpuPoolMoEMethod.apply`` call vLLM makes during decode steps of
batch B (the method wrapped with a timer; prefill calls, whose row count is not B, are left out),
which is everything the plugin adds around the pool. Direct: the same pool object's ``forward``
on the very inputs vLLM passed (recorded in the wrapper, cloned), called from this script
between engine steps. Each repeat runs one generation (inside) and then replays its inputs
(direct); the ratio inside / direct is taken per repeat on the median of each, then the median
over repeats (and, less exposed to a noisy neighbour, the median over every call of its inside
time over its own direct replay: ``pairwise_median``). Both run in the same process on the same pool threads, so the ratio isolates what
serving through vLLM costs the pool (glue, dtype casts, threads beside it).

Run in the vLLM venv (``.venv-vllm``, hetquant installed there editable)::

    .venv-vllm/bin/python benchmarks/bench_pool_in_vllm.py --work /tmp/piv [--experts 256]

The pool side of kt-kernel's comparison is ``bench_kt_side_by_side.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _measure import machine_info, write_result  # noqa: E402
from make_synthetic import is_current, write_checkpoint  # noqa: E402

VOCAB = 1024


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="source and artifact are kept here")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=6, help="decode steps per generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="vLLM's activation dtype")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "bench_pool_in_vllm.json")
    return ap.parse_args()


def artifact(work: Path, experts: int) -> Path:
    """The hybrid artifact of one real-shape MoE layer, made once per ``work``."""
    src, out = work / "src", work / f"hybrid-{experts}"
    if not is_current(src, experts, VOCAB, 0, dense_layers=0):
        write_checkpoint(src, experts=experts, vocab=VOCAB, dense_layers=0, jobs=2)
    if not (out / "manifest.json").is_file():
        exe = Path(sys.executable).with_name("hetquant")
        cmd = [str(exe), "convert", str(src), str(out), "--recipe", "ascend-hybrid", "--overwrite"]
        subprocess.run(cmd, check=True)
    return out


class Timed:
    """Wraps ``CpuPoolMoEMethod.apply``: per call, its wall time and (for calls of ``rows``
    rows) a clone of its inputs with the layer, to replay directly."""

    def __init__(self) -> None:
        from hetquant.runtime.vllm import moe

        self.moe, self.orig = moe, moe.CpuPoolMoEMethod.apply
        self.rows, self.calls = 0, []  # calls: (seconds, layer, pool, x, ids, weights)
        timed = self

        def apply(method: Any, layer: Any, x: Any, topk_weights: Any, topk_ids: Any, *a: Any,
                  **kw: Any) -> Any:  # fmt: skip
            t0 = time.perf_counter()
            y = timed.orig(method, layer, x, topk_weights, topk_ids, *a, **kw)
            dt = time.perf_counter() - t0
            w, ids = topk_weights, topk_ids
            if x.shape[0] == timed.rows:
                pool = getattr(layer, moe.POOL)
                timed.calls.append((dt, method.layer_no, pool, x.clone(), ids.clone(), w.clone()))
            return y

        moe.CpuPoolMoEMethod.apply = apply


def direct(calls: list) -> list[float]:
    """The pool's own ``forward`` on each recorded call's inputs, timed."""
    out = []
    for _, layer_no, pool, x, ids, w in calls:
        t0 = time.perf_counter()
        pool.forward(layer_no, x, ids, w)
        out.append(time.perf_counter() - t0)
    return out


def one_batch(llm: Any, timed: Timed, batch: int, args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * b + j) % VOCAB for j in range(5)]} for b in range(batch)]
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    ratios, inside_ms, direct_ms, pairs = [], [], [], []
    for _ in range(args.repeats):
        timed.rows, timed.calls = batch, []
        llm.generate(prompts, sp, use_tqdm=False)
        ins = [c[0] for c in timed.calls]
        if not ins:
            raise SystemExit(f"no decode call of {batch} rows reached the pool")
        dirs = direct(timed.calls)
        pairs += [i / d for i, d in zip(ins, dirs, strict=True)]
        inside_ms.append(statistics.median(ins) * 1e3)
        direct_ms.append(statistics.median(dirs) * 1e3)
        ratios.append(inside_ms[-1] / direct_ms[-1])
    timed.rows = 0
    return {
        "batch": batch,
        "calls_per_repeat": len(timed.calls),
        "inside_ms": round(statistics.median(inside_ms), 3),
        "direct_ms": round(statistics.median(direct_ms), 3),
        "ratio_inside_over_direct": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "pairwise_median": round(statistics.median(pairs), 3),
    }


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = artifact(args.work, args.experts)
    timed = Timed()
    from vllm import LLM

    # vLLM takes its AMX_MLA backend where the CPU has AMX, and it runs bf16 only: other dtypes
    # ask for CPU_MLA, what a CPU without AMX gets (docs/serving-vllm.md)
    mla = {} if args.dtype == "bfloat16" else {"attention_backend": "CPU_MLA"}
    llm = LLM(
        model=str(model), quantization="hetquant", load_format="hetquant", dtype=args.dtype,
        enforce_eager=True, max_model_len=64, max_num_seqs=max(args.batches), seed=0,
        skip_tokenizer_init=True, gpu_memory_utilization=0.1, **mla,
    )  # fmt: skip
    rows = []
    try:
        for b in args.batches:
            rows.append(one_batch(llm, timed, b, args))
            r = rows[-1]
            print(
                f"batch {b:3d}: inside vLLM {r['inside_ms']:8.2f} ms  direct {r['direct_ms']:8.2f} ms"
                f"  inside/direct {r['ratio_inside_over_direct']:.3f} {r['ratios']}"
                f"  per call {r['pairwise_median']:.3f}",
                flush=True,
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
    result = {"experts": args.experts, "dtype": args.dtype, "steps": args.steps, "rows": rows}
    write_result(args.json, {"machine": machine_info(), **result})


if __name__ == "__main__":
    main()
