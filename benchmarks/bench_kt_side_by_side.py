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

Run it in kt-kernel's environment (``benchmarks/notes/kt-kernel.md``)::

    python benchmarks/bench_kt_side_by_side.py [--kind amxint4] [--experts 256] [--batches 1 8 64] [--threads 1 2]

``--materialize``: our pools copy the layer into private memory on transparent huge pages
(``CpuExpertPool.open(materialize=True)``), as kt-kernel holds its own copy; by default they
serve the page cache through the file mapping (4 KB pages).

``--ours-only`` (no kt-kernel needed, no export): our pool against itself before ``int4_moe``
(``fused=False``: one ``int4_gemv`` call per expert and projection, torch glue between), in the
same interleaved way, so the ratio is new / old on this machine; the rows also show kt's time
recorded in ``--recorded`` (default ``results/bench_kt_side_by_side.json``, kt measured there)
and our time over it — a ratio across runs, not interleaved, for a quick look only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kt
from _measure import machine_info, replace_marked, write_result

HERE = Path(__file__).resolve().parent
START, END = "<!-- bench_kt_side_by_side:start -->", "<!-- bench_kt_side_by_side:end -->"


def expert_bytes(h: int, i: int, group: int) -> int:
    codes = 3 * h * i // 2
    return codes + (2 * 3 * h * i // group if group else 4 * (2 * i + h))


def parse_args() -> argparse.Namespace:
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
    ap.add_argument(
        "--ours-only",
        action="store_true",
        help="ours against ours before int4_moe (no kt-kernel; module docstring)",
    )
    ap.add_argument("--recorded", default=str(HERE / "results" / "bench_kt_side_by_side.json"))
    ap.add_argument(
        "--materialize",
        action="store_true",
        help="our pools copy the layer into private memory (huge pages), as kt does",
    )
    args = ap.parse_args()
    if args.ours_only and args.json == ap.get_default("json"):
        args.json = str(HERE / "results" / "bench_kt_side_by_side-ours.json")
    return args


def open_systems(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The synthetic layer, its kt export (not with ``--ours-only``), and per thread count our
    pool and the other side (kt-kernel's MoE, or our per-expert loop)."""
    from hetquant.runtime.experts.expert_pool import CpuExpertPool
    from hetquant.runtime.kernels.int4_gemv import native_info

    if args.ours_only:
        kind = args.kind or "amxint4"
    else:
        from kt_kernel.utils import amx as ktamx

        kind = args.kind or ("amxint4" if ktamx.AMXInt4_MOE is not None else "rawint4")
    to, method, group = {"amxint4": ("kt-amxint4", "AMXINT4", 0),
                         "rawint4": ("kt-rawint4", "RAWINT4", 32)}[kind]  # fmt: skip
    e, h, i, k = args.experts, args.hidden, args.inter, args.topk
    t0 = time.perf_counter()
    art = _kt.make_hybrid(work, e, h, i, group, seed=0)
    out = None if args.ours_only else _kt.export(art, to, 1)
    print(f"artifact + export in {time.perf_counter() - t0:.0f} s", flush=True)
    maxb, mat = max(args.batches), args.materialize
    systems: dict[tuple[str, int], Any] = {}
    for t in args.threads:
        if args.ours_only:
            systems["loop", t] = CpuExpertPool.open(art, threads=t, fused=False, materialize=mat)
        else:
            systems["kt", t] = _kt.KtMoE(out, method, e, k, h, i, t, 1, max_len=max(maxb, 128))
        systems["ours", t] = CpuExpertPool.open(art, threads=t, materialize=mat)
    backend = "ours before int4_moe" if args.ours_only else systems["kt", args.threads[0]].backend
    print(f"against: {backend}, ours {native_info()['isa']}", flush=True)
    other = "loop" if args.ours_only else "kt"
    return {"kind": kind, "group": group, "backend": backend, "other": other, "systems": systems}


def call(sides: dict[str, Any], name: str, t: int, x: Any, ids: Any, w: Any) -> Any:
    s = sides["systems"][name, t]
    torch.set_num_threads(t)
    return s.forward(x, ids, w) if name == "kt" else s.forward(_kt.LAYER, x, ids, w)


def measure(args: argparse.Namespace, sides: dict[str, Any]) -> tuple[dict, float]:
    """Per (system, batch, threads): (wall, CPU, experts touched) per call, each repeat; ours and
    the other side on the same inputs, order alternating. Also their agreement on one input."""
    e, h, k, other = args.experts, args.hidden, args.topk, sides["other"]
    g = torch.Generator().manual_seed(1)
    samples: dict[tuple, list] = {}
    for rep in range(args.repeats):
        for b in args.batches:
            for t in args.threads:
                inputs = []
                for c in range(args.calls):
                    ids, w = _kt.routing(b, e, k, seed=1000 * rep + 10 * b + c)
                    x = torch.randn(b, h, generator=g).to(torch.bfloat16)
                    inputs.append((x, ids, w))
                order = ["ours", other] if rep % 2 == 0 else [other, "ours"]
                for name in order:
                    w0, c0 = time.perf_counter(), time.process_time()
                    for x, ids, w in inputs:
                        call(sides, name, t, x, ids, w)
                    wall = (time.perf_counter() - w0) / args.calls
                    cpu = (time.process_time() - c0) / args.calls
                    touched = statistics.mean(len(set(ids.flatten().tolist())) for _, ids, _ in inputs)  # fmt: skip
                    samples.setdefault((name, b, t), []).append((wall, cpu, touched))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    # agreement on one input (both hold the same codes and scales; ours and loop: the same bits)
    x, ids, w = inputs[0]
    ours = call(sides, "ours", t, x, ids, w).to(torch.float64)
    return samples, _kt.rel_err(call(sides, other, t, x, ids, w), ours)


def summarize(args: argparse.Namespace, samples: dict, other: str, per_expert: int) -> list:
    """One row per (system, batch, threads): medians, and the time ratio ours / other."""
    recorded = _recorded_kt(Path(args.recorded)) if args.ours_only else {}
    rows = []
    for b in args.batches:
        for t in args.threads:
            ours, kt = samples["ours", b, t], samples[other, b, t]
            ratio = statistics.median(o[0] / q[0] for o, q in zip(ours, kt, strict=True))
            for name, smp in (("ours", ours), (other, kt)):
                wall = statistics.median(s[0] for s in smp)
                rows.append({
                    "system": name, "batch": b, "threads": t, "ms_per_call": wall * 1e3,
                    "ms_per_token": wall * 1e3 / b,
                    "cpu_ms_per_call": statistics.median(s[1] for s in smp) * 1e3,
                    "weight_gbps": statistics.median(s[2] * per_expert / s[0] for s in smp) / 1e9,
                    f"ratio_ours_over_{other}": ratio,
                    "samples_ms": [round(s[0] * 1e3, 2) for s in smp],
                })  # fmt: skip
                if name == "ours" and (b, t) in recorded:
                    rows[-1]["kt_recorded_ms"] = recorded[b, t]
                    rows[-1]["ratio_ours_over_kt_recorded"] = (
                        rows[-1]["ms_per_call"] / recorded[b, t]
                    )
    return rows


def main() -> int:
    args = parse_args()
    _kt.import_hetquant()
    from hetquant.runtime.kernels.int4_gemv import native_info

    work = Path(args.work or tempfile.mkdtemp(prefix="hetquant-ktbench-"))
    sides = open_systems(args, work)
    samples, agree = measure(args, sides)
    for s in sides["systems"].values():
        if hasattr(s, "close"):
            s.close()
    per_expert = expert_bytes(args.hidden, args.inter, sides["group"])
    rows = summarize(args, samples, sides["other"], per_expert)
    env = {"torch": torch.__version__} if args.ours_only else _kt.environment()
    doc = {"machine": machine_info(), "environment": env, "kind": sides["kind"],
           "against": sides["other"], "materialize": args.materialize,
           "kt_backend": sides["backend"], "ours_isa": native_info()["isa"],
           "experts": args.experts, "hidden": args.hidden, "inter": args.inter,
           "topk": args.topk, "expert_bytes": per_expert, "rel_err_kt_vs_ours": agree,
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
    m, other = doc["machine"], doc.get("against", "kt")
    env = doc["environment"]
    against = (
        f"kt-kernel {env['kt_kernel']} `{doc['kt_backend']}` ({env['kt_variant']})"
        if other == "kt"
        else "our pool before int4_moe (`fused=False`)"
    )
    head = (
        f"`{doc['command']}` · {m.get('cpu_model', '?')}, {m.get('nproc', '?')} CPUs · "
        f"{against} against ours `{doc['ours_isa']}` · "
        f"{doc['experts']} experts [H {doc['hidden']}, I {doc['inter']}] top-{doc['topk']}, "
        f"{doc['expert_bytes']:,} B per expert · {other} vs ours on one input: "
        f"{doc['rel_err_kt_vs_ours']:.2e}\n\n"
    )
    extra = other != "kt"
    lines = ["| system | threads | batch | ms / call | ms / token | CPU ms / call | weight GB/s | "
             f"time ratio ours / {other} |" + (" kt recorded ms | ours / kt recorded |" if extra else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if extra else "")]  # fmt: skip
    for r in doc["rows"]:
        ratio = f"**{r[f'ratio_ours_over_{other}']:.2f}**" if r["system"] == "ours" else ""
        line = (f"| {r['system']} | {r['threads']} | {r['batch']} | {r['ms_per_call']:.1f} | "
                f"{r['ms_per_token']:.2f} | {r['cpu_ms_per_call']:.1f} | "
                f"{r['weight_gbps']:.2f} | {ratio} |")  # fmt: skip
        if extra:
            rec = r.get("kt_recorded_ms")
            line += f" {rec:.1f} | {r['ratio_ours_over_kt_recorded']:.2f} |" if rec else " | |"
        lines.append(line)
    return head + "\n".join(lines) + "\n"


def _recorded_kt(path: Path) -> dict[tuple[int, int], float]:
    """kt's ms per call by (batch, threads) from an earlier side-by-side result (if any)."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["batch"], r["threads"]): r["ms_per_call"] for r in rows if r["system"] == "kt"}


if __name__ == "__main__":
    raise SystemExit(main())
