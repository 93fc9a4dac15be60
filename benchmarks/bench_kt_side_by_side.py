"""Side by side, one run, interleaved: our CpuExpertPool against kt-kernel's MoE on one MoE layer.

One DeepSeek-V3 MoE layer (256 experts, H 7168, I 2048, top-8 by default) of random codes and
scales (``_kt.make_hybrid``), exported with ``hetquant export`` and loaded into kt-kernel 0.7.2
(``--kind amxint4``: per-channel experts, kt's ``AMXInt4_MOE`` from the ``.kt`` tree, AVX-512
variants only; ``--kind rawint4``: group-32 experts, kt's RAWINT4 backend), so both systems hold
the same codes and scales. For each batch and thread count, each repeat times ``--calls`` calls
of each system on the same fresh tokens and routings, the two in alternating order; reported:
medians over repeats of ms per call, weight GB/s (distinct experts the call touches × bytes per
expert / wall time: the layer is far larger than the caches, so weights stream from DRAM) and
the ratio of our time to kt's, per repeat, median (below 1: ours is faster). Threads: ours
``CpuExpertPool.open(threads=t)``; kt ``CPUInfer`` with ``t`` worker threads in one pool.

Run it in kt-kernel's environment (``benchmarks/README.md``)::

    python benchmarks/bench_kt_side_by_side.py [--kind amxint4] [--experts 256] [--batches 1 8 64] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kt
from _measure import machine_info, replace_marked, write_result

HERE = Path(__file__).resolve().parent
START, END = "<!-- bench_kt_side_by_side:start -->", "<!-- bench_kt_side_by_side:end -->"


def expert_bytes(h: int, i: int, group: int) -> int:
    codes = 3 * h * i // 2
    return codes + (2 * 3 * h * i // group if group else 4 * (2 * i + h))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["amxint4", "rawint4"], default=None,
                    help="default: amxint4 where kt has it, else rawint4")  # fmt: skip
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=str(HERE / "results" / "bench_kt_side_by_side.json"))
    ap.add_argument("--readme", default=None, help="update this README's marked table")
    args = ap.parse_args()
    _kt.import_hetquant()
    from kt_kernel.utils import amx as ktamx

    from hetquant.runtime.experts.expert_pool import CpuExpertPool
    from hetquant.runtime.kernels.int4_gemv import native_info

    kind = args.kind or ("amxint4" if ktamx.AMXInt4_MOE is not None else "rawint4")
    to, method, group = {"amxint4": ("kt-amxint4", "AMXINT4", 0),
                         "rawint4": ("kt-rawint4", "RAWINT4", 32)}[kind]  # fmt: skip
    e, h, i, k = args.experts, args.hidden, args.inter, args.topk
    work = Path(args.work or tempfile.mkdtemp(prefix="hetquant-ktbench-"))
    t0 = time.perf_counter()
    art = _kt.make_hybrid(work, e, h, i, group, seed=0)
    out = _kt.export(art, to, 1)
    print(f"artifact + export in {time.perf_counter() - t0:.0f} s", flush=True)
    maxb = max(args.batches)
    systems = {}
    for t in args.threads:
        systems["kt", t] = _kt.KtMoE(out, method, e, k, h, i, t, 1, max_len=max(maxb, 128))
        systems["ours", t] = CpuExpertPool.open(art, subpools=1, threads=t)
    backend = systems["kt", args.threads[0]].backend
    print(f"kt {backend}, ours {native_info()['isa']}", flush=True)

    def call(
        name: str, t: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        s = systems[name, t]
        torch.set_num_threads(t)
        return s.forward(x, ids, w) if name == "kt" else s.forward(_kt.LAYER, x, ids, w)

    g = torch.Generator().manual_seed(1)
    per_expert = expert_bytes(h, i, group)
    samples: dict[tuple, list] = {}
    for rep in range(args.repeats):
        for b in args.batches:
            for t in args.threads:
                inputs = []
                for c in range(args.calls):
                    ids, w = _kt.routing(b, e, k, seed=1000 * rep + 10 * b + c)
                    x = torch.randn(b, h, generator=g).to(torch.bfloat16)
                    inputs.append((x, ids, w))
                order = ["ours", "kt"] if rep % 2 == 0 else ["kt", "ours"]
                for name in order:
                    w0, c0 = time.perf_counter(), time.process_time()
                    for x, ids, w in inputs:
                        call(name, t, x, ids, w)
                    wall = (time.perf_counter() - w0) / args.calls
                    cpu = (time.process_time() - c0) / args.calls
                    touched = statistics.mean(len(set(ids.flatten().tolist())) for _, ids, _ in inputs)  # fmt: skip
                    samples.setdefault((name, b, t), []).append((wall, cpu, touched))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    # agreement on one input (both hold the same codes and scales)
    x, ids, w = inputs[0]
    agree = _kt.rel_err(call("kt", t, x, ids, w), call("ours", t, x, ids, w).to(torch.float64))
    for s in systems.values():
        if hasattr(s, "close"):
            s.close()
    rows = []
    for b in args.batches:
        for t in args.threads:
            ours, kt = samples["ours", b, t], samples["kt", b, t]
            ratio = statistics.median(o[0] / q[0] for o, q in zip(ours, kt, strict=True))
            for name, smp in (("ours", ours), ("kt", kt)):
                wall = statistics.median(s[0] for s in smp)
                rows.append({
                    "system": name, "batch": b, "threads": t, "ms_per_call": wall * 1e3,
                    "ms_per_token": wall * 1e3 / b,
                    "cpu_ms_per_call": statistics.median(s[1] for s in smp) * 1e3,
                    "weight_gbps": statistics.median(s[2] * per_expert / s[0] for s in smp) / 1e9,
                    "ratio_ours_over_kt": ratio, "samples_ms": [round(s[0] * 1e3, 2) for s in smp],
                })  # fmt: skip
    doc = {"machine": machine_info(), "environment": _kt.environment(), "kind": kind,
           "kt_backend": backend, "ours_isa": native_info()["isa"], "experts": e, "hidden": h,
           "inter": i, "topk": k, "expert_bytes": per_expert, "rel_err_kt_vs_ours": agree,
           "command": " ".join(sys.argv), "rows": rows}  # fmt: skip
    write_result(args.json, doc)
    table = render(doc)
    print(table)
    if args.readme and not replace_marked(Path(args.readme), START, END, table):
        print(f"{args.readme}: no {START} markers", file=sys.stderr)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def render(doc: dict) -> str:
    m = doc["machine"]
    head = (
        f"`{doc['command']}` · {m.get('cpu_model', '?')}, {m.get('nproc', '?')} CPUs · "
        f"kt-kernel {doc['environment']['kt_kernel']} `{doc['kt_backend']}` "
        f"({doc['environment']['kt_variant']}) against ours `{doc['ours_isa']}` · "
        f"{doc['experts']} experts [H {doc['hidden']}, I {doc['inter']}] top-{doc['topk']}, "
        f"{doc['expert_bytes']:,} B per expert · kt vs ours on one input: "
        f"{doc['rel_err_kt_vs_ours']:.2e}\n\n"
    )
    lines = ["| system | threads | batch | ms / call | ms / token | CPU ms / call | weight GB/s | time ratio ours / kt |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc["rows"]:
        ratio = f"**{r['ratio_ours_over_kt']:.2f}**" if r["system"] == "ours" else ""
        lines.append(f"| {r['system']} | {r['threads']} | {r['batch']} | {r['ms_per_call']:.1f} | "
                     f"{r['ms_per_token']:.2f} | {r['cpu_ms_per_call']:.1f} | "
                     f"{r['weight_gbps']:.2f} | {ratio} |")  # fmt: skip
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
