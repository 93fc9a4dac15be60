"""CPU INT4 expert GEMV against memory bandwidth and a bf16 GEMV, in one run.

Measures, interleaved repeat by repeat (medians reported):

- memory bandwidth: ``sum`` of a 1 GiB float32 buffer (read-only, like a GEMV) and ``copy_`` of
  it (read + write counted), with 1 thread and with all of torch's threads;
- GEMV on DeepSeek expert shapes, gate_up ``[2·2048, 7168]`` and down ``[7168, 2048]``, batch 1
  and 8 (``--batches``), for
  - ``int4 native``: ``runtime.int4_gemv`` native kernel (float32 activations), precision
    ``high`` (22-bit fixed-point activations, the default) and ``fast`` (14-bit),
  - ``int4 torch``: the pure-torch path (unpack → float32 → matmul),
  - ``int4 aten``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bf16 activations, weights
    repacked with ``_convert_weight_to_int4pack_for_cpu``, per-row scale repeated per group
    of 256, ``zero = 0``) — torch's own int4 CPU kernel, for comparison,
  - ``bf16``: ``x @ W.T`` on bf16 weights of the same shape (oneDNN/MKL);
- one routed-expert layer end to end: ``CpuExpertPool.forward`` with top-8 of 16 experts of
  DeepSeek size, batch 1, subpools 1 and 2 (a synthetic artifact written to ``--work``);
- ``int4 native group32``: the same codes with group-wise BF16 scales (``int4_cpu_group``, group
  ``--group-size``), called right after the per-channel kernel on the same copy index in every
  repeat (order alternating), and its weight-bytes throughput as a ratio of the per-channel
  kernel's: the median over repeats of the per-repeat ratio (issue target ≥ 0.9).
  ``--group`` runs only this comparison (both precisions, 1 and all threads) and writes its own
  JSON (``results/bench_expert_gemv-group.json``) and README table; ``--group --in-cache``
  the same with every call on copy 0, so that the weights come from the last-level cache (one
  matrix, 7–15 MB, against 32 MB of L3 here) and the kernels' arithmetic decides
  (``results/bench_expert_gemv-group-incache.json``, the ``bench_expert_gemv:group-incache``
  table);
- ``--gemm``: the per-channel kernel (22-bit) at ``--batches`` (default 16 and 64) in its plain
  order (``token_block=0``) and in the GEMM-shaped, token-blocked order (the default from 16
  tokens on), back to back on the same copy (order alternating), 1 and all threads: the ratio
  of their weight GB/s, per repeat, median (``results/bench_expert_gemv-gemm.json`` and the
  ``bench_expert_gemv:gemm`` README table).

Every matrix is cycled through ``--set-mb`` MB of distinct copies (default 256, 8× the 32 MB L3
here), so weights stream from DRAM as in serving, not from cache. GB/s counts the weight bytes a
call must read (int4: N·K/2 + 4N; group-wise: N·K/2 + 2·N·K/g; aten adds its bf16 scale/zero
table; bf16: 2·N·K).

Usage::

    python benchmarks/bench_expert_gemv.py                    # JSON + README table
    python benchmarks/bench_expert_gemv.py --repeats 3 --no-readme

Writes ``benchmarks/results/bench_expert_gemv.json`` and the table in ``benchmarks/notes/expert-gemv.md``
(between the ``bench_expert_gemv`` markers of the "CPU INT4 expert GEMV" section); with
``--group``, ``results/bench_expert_gemv-group.json`` and the ``bench_expert_gemv:group`` table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import machine_info, median, replace_marked, write_result  # noqa: E402

SECTION = "## CPU INT4 expert GEMV"
START = "<!-- bench_expert_gemv:results:start -->"
END = "<!-- bench_expert_gemv:results:end -->"
GROUP_START = "<!-- bench_expert_gemv:group:start -->"
GROUP_END = "<!-- bench_expert_gemv:group:end -->"
INCACHE_START = "<!-- bench_expert_gemv:group-incache:start -->"
INCACHE_END = "<!-- bench_expert_gemv:group-incache:end -->"
GEMM_START = "<!-- bench_expert_gemv:gemm:start -->"
GEMM_END = "<!-- bench_expert_gemv:gemm:end -->"
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
GiB = 1 << 30


def lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    info = {}
    for line in out.splitlines():
        k, _, v = line.partition(":")
        info[k.strip()] = v.strip()
    flags = set(info.get("Flags", "").split())
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)")
    res = {k: info[k] for k in keep if k in info}
    res["L3"] = info.get("L3 cache", "?")
    res["isa"] = " ".join(
        f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f in flags
    )
    res["hypervisor"] = info.get("Hypervisor vendor", "")
    return res


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class Timer:
    """Named measurements; each call of ``run`` times ``fn`` over all its copies once.

    Records wall time and the calling thread's CPU time (``time.thread_time``). On a shared
    machine the wall time includes the time the thread waited for a CPU; for single-threaded
    work (rows ending in ``/1t``) ``bytes / CPU time`` is the rate while actually running.
    """

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.bytes: dict[str, int] = {}

    def run(self, name: str, fn: Callable[[int], object], copies: int, nbytes: int) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        for i in range(copies):
            fn(i)
        dt = (time.perf_counter() - t0) / copies
        dc = (time.thread_time() - c0) / copies
        self.samples.setdefault(name, []).append(dt)
        self.cpu.setdefault(name, []).append(dc)
        self.bytes[name] = nbytes

    def summary(self) -> dict[str, dict[str, Any]]:
        out = {}
        for k, v in self.samples.items():
            t = median(v)
            out[k] = {
                "ms": t * 1e3,
                "gbps": self.bytes[k] / t / 1e9,
                "bytes": self.bytes[k],
                "samples_ms": [round(s * 1e3, 4) for s in v],
            }
            if k.endswith("/1t") and not k.startswith("pool/"):  # work in this thread
                c = median(self.cpu[k])
                out[k]["cpu_ms"] = c * 1e3
                out[k]["cpu_gbps"] = self.bytes[k] / c / 1e9 if c > 0 else None
        return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--set-mb", type=int, default=256, help="MB of distinct weight copies")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    ap.add_argument("--skip-slow", action="store_true", help="skip the pure-torch int4 path")
    ap.add_argument("--no-pool", action="store_true", help="skip the CpuExpertPool layer run")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--json", default=str(HERE / "results" / "bench_expert_gemv.json"))
    ap.add_argument("--readme", default=str(HERE / "notes" / "expert-gemv.md"))
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--group", action="store_true", help="only per-channel vs group-wise")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--in-cache", action="store_true", help="--group: every call on copy 0")
    ap.add_argument("--gemm", action="store_true", help="only plain vs token-blocked order")
    args = ap.parse_args()
    if args.gemm:
        args.group, args.skip_slow, args.no_pool = True, True, True  # the --group code path
        if args.batches == ap.get_default("batches"):
            args.batches = [16, 64]
        if args.json == ap.get_default("json"):
            args.json = str(HERE / "results" / "bench_expert_gemv-gemm.json")
    if args.in_cache and not args.group:
        ap.error("--in-cache goes with --group")
    if args.group:
        args.skip_slow, args.no_pool = True, True
        if args.json == ap.get_default("json"):
            name = "group-incache" if args.in_cache else "group"
            args.json = str(HERE / "results" / f"bench_expert_gemv-{name}.json")
    return args


def aten_weights(packed: Any, scale: Any, copies: int) -> dict[str, Any] | None:
    """torch's own int4 CPU kernel's repack of copy 0 (per-row scale repeated per group of 256,
    zero 0), cloned ``copies`` times; None where this torch lacks the kernel."""
    import torch

    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    n, k = packed.shape[0], packed.shape[1] * 2
    gs = 256
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(n, k).to(torch.int32)
    p0 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    del codes
    sz = torch.zeros(k // gs, n, 2, dtype=torch.bfloat16)
    sz[..., 0] = scale.to(torch.bfloat16)
    return {
        "gs": gs,
        "packed": [p0] + [p0.clone() for _ in range(copies - 1)],
        "sz": [sz.clone() for _ in range(copies)],
        "bytes": p0.numel() + sz.numel() * 2,
    }


def make_weights(args: argparse.Namespace, g: Any) -> dict[str, dict[str, Any]]:
    """Per shape: random INT4 codes and scales (per-channel and group-wise), bf16 weights and
    aten's repack, each in enough distinct copies to fill ``--set-mb``."""
    import torch

    data: dict[str, dict[str, Any]] = {}
    for name, (n, k) in SHAPES.items():
        int4_bytes = n * k // 2 + 4 * n
        copies = max(4, args.set_mb * (1 << 20) // int4_bytes)
        packed = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)]
        packed += [packed[0].clone() for _ in range(copies - 1)]
        scale = [torch.rand(n, generator=g) * 0.01 + 1e-4 for _ in range(copies)]
        gs_ = args.group_size
        gscale = [
            (torch.rand(n, k // gs_, generator=g) * 0.01 + 1e-4).bfloat16() for _ in range(copies)
        ]
        bf16_copies = 0 if args.group else max(4, args.set_mb * (1 << 20) // (2 * n * k))
        w16 = [torch.randn(n, k, generator=g).to(torch.bfloat16) for _ in range(bf16_copies)]
        aten = None if args.group else aten_weights(packed[0], scale[0], copies)
        data[name] = {
            "n": n,
            "k": k,
            "packed": packed,
            "scale": scale,
            "int4_bytes": int4_bytes,
            "gscale": gscale,
            "group_bytes": n * k // 2 + 2 * n * k // gs_,
            "w16": w16,
            "aten": aten,
        }
        print(f"{name} [{n}, {k}]: {copies} int4 copies, {bf16_copies} bf16 copies")
    return data


def spot_check(G: Any, data: dict[str, dict[str, Any]], g: Any) -> None:
    """The native kernel agrees with the torch path on these shapes, both scale layouts."""
    import torch

    for name, d in data.items():
        x = torch.randn(2, d["k"], generator=g)
        for skey in ("scale", "gscale"):
            a = G.int4_gemv(d["packed"][0], d[skey][0], x, backend="auto")
            b = G.int4_gemv(d["packed"][0], d[skey][0], x, backend="torch")
            rel = ((a - b).abs().max() / b.abs().max()).item()
            assert rel < 1e-5, (name, skey, rel)


def open_pools(args: argparse.Namespace, work: Path, nthreads: int) -> list[tuple[str, Any]]:
    """CpuExpertPools over one synthetic DeepSeek-size layer, per (subpools, threads) setting."""
    if args.no_pool:
        return []
    from _kt import make_hybrid

    from hetquant.runtime.experts.expert_pool import CpuExpertPool

    art = make_hybrid(work, experts=16, hidden=7168, inter=2048, group=0, seed=1)
    pools = []
    for s in sorted({1, 2, nthreads}):
        for th in sorted({1, max(1, nthreads // s)}):
            pools.append((f"S{s}/{th}t", CpuExpertPool.open(art, subpools=s, threads=th)))
    return pools


def time_native(
    timer: Timer, args: argparse.Namespace, G: Any, rep: int, threads: list[int], row: tuple
) -> None:
    """The native kernel on one shape and batch: per-channel and group-wise (or, with
    ``--gemm``, plain and token-blocked order) back to back, order alternating by repeat."""
    name, b, x, d = row
    for th in threads:
        for prec in ("high", "fast"):
            kinds = [("", "scale", "int4_bytes", None), ("group", "gscale", "group_bytes", None)]
            if args.gemm:  # per-channel, plain order vs token-blocked
                kinds = [("plain", "scale", "int4_bytes", 0), ("gemm", "scale", "int4_bytes", None)]
                if prec == "fast":
                    continue
            for kind, skey, bkey, tb in kinds[:: 1 if rep % 2 else -1]:
                size = str(args.group_size) if kind == "group" else ""
                timer.run(
                    f"{name}/b{b}/int4_native{kind and '_' + kind}{size}_{prec}/{th}t",
                    lambda i, th=th, prec=prec, skey=skey, tb=tb: G.int4_gemv(
                        d["packed"][0 if args.in_cache else i],
                        d[skey][0 if args.in_cache else i],
                        x,
                        backend="native",
                        threads=th,
                        precision=prec,
                        token_block=tb,
                    ),
                    len(d["packed"]),
                    d[bkey],
                )


def time_references(
    timer: Timer, args: argparse.Namespace, G: Any, rep: int, threads: list[int], row: tuple
) -> None:
    """The comparison paths on one shape and batch: pure torch, aten's int4 kernel, bf16."""
    import torch

    name, b, x, d = row
    nthreads = torch.get_num_threads()
    x16, w16 = x.to(torch.bfloat16), d["w16"]
    ncp = len(d["packed"])
    if not args.skip_slow and rep < max(2, args.repeats // 3):
        timer.run(
            f"{name}/b{b}/int4_torch/{nthreads}t",
            lambda i: G.int4_gemv_torch(d["packed"][i], d["scale"][i], x),
            min(ncp, 4),
            d["int4_bytes"],
        )
    for th in threads if not args.group else ():
        torch.set_num_threads(th)
        if (at := d["aten"]) is not None:
            timer.run(
                f"{name}/b{b}/int4_aten_bf16/{th}t",
                lambda i, at=at: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x16, at["packed"][i], at["gs"], at["sz"][i]
                ),
                ncp,
                at["bytes"],
            )
        timer.run(
            f"{name}/b{b}/bf16/{th}t", lambda i: x16 @ w16[i].T, len(w16), 2 * d["n"] * d["k"]
        )
    torch.set_num_threads(nthreads)


def time_pools(timer: Timer, pools: list[tuple[str, Any]], g: Any) -> None:
    """One token through each pool's layer: top-8 of 16 experts, four tokens cycled."""
    import torch

    layer_bytes = 8 * (2 * 2048 * 7168 // 2 + 4 * 2 * 2048 + 7168 * 2048 // 2 + 4 * 7168)
    for s, pool in pools:
        layer = pool.layers[0]
        ids = torch.stack([torch.randperm(16, generator=g)[:8] for _ in range(4)])
        w = torch.rand(4, 8, generator=g)
        x = torch.randn(4, 7168, generator=g).to(torch.bfloat16)
        # four different tokens → four different expert sets (cycles the 16 experts)
        timer.run(
            f"pool/b1/forward/{s}",
            lambda i, pool=pool, layer=layer, x=x, ids=ids, w=w: pool.forward(
                layer, x[i : i + 1], ids[i : i + 1], w[i : i + 1]
            ),
            4,
            layer_bytes,
        )


def summarize(timer: Timer, args: argparse.Namespace, nthreads: int) -> dict[str, Any]:
    """Medians, each row against the measured bandwidth and bf16, and the group / gemm ratios."""
    res = timer.summary()
    bw_read = max(v["gbps"] for k, v in res.items() if k.startswith("bw/read/"))
    bw_copy = max(v["gbps"] for k, v in res.items() if k.startswith("bw/copy/"))
    bandwidth = max(bw_read, bw_copy)
    bw_cpu = res.get("bw/read/1t", {}).get("cpu_gbps")
    for v in res.values():
        v["pct_of_bandwidth"] = 100 * v["gbps"] / bandwidth
        if v.get("cpu_gbps") and bw_cpu:
            v["cpu_pct_of_bandwidth"] = 100 * v["cpu_gbps"] / bw_cpu
    group_ratios(timer, res, "gemm" if args.gemm else "group")
    # speed against bf16 (time ratio) for every GEMV row
    for k, v in res.items():
        parts = k.split("/")
        if len(parts) == 4 and parts[0] in SHAPES:
            ref = res.get(f"{parts[0]}/{parts[1]}/bf16/{parts[3]}") or res.get(
                f"{parts[0]}/{parts[1]}/bf16/{nthreads}t"
            )
            if ref:
                v["speedup_vs_bf16"] = ref["ms"] / v["ms"]
    return {
        "bandwidth_gbps": {
            "read": bw_read,
            "copy": bw_copy,
            "reference": bandwidth,
            "read_1t_cpu_time": bw_cpu,
        },
        "target_pct_batch1": 60.0,
        "results": res,
    }


def publish(args: argparse.Namespace, doc: dict[str, Any], nthreads: int) -> None:
    """The JSON, the table printed, and the table put between its markers in the note."""
    write_result(args.json, doc)
    print(f"wrote {args.json}")
    table = render_group(doc, args.gemm) if args.group else render(doc, nthreads)
    print(table)
    if args.no_readme:
        return
    if args.group:
        start, end = (GEMM_START, GEMM_END) if args.gemm else (GROUP_START, GROUP_END)
        if args.in_cache:
            start, end = INCACHE_START, INCACHE_END
        if not replace_marked(Path(args.readme), start, end, table):
            raise SystemExit(f"{args.readme}: no {start} … {end} markers")
    else:
        update_readme(Path(args.readme), table)
    print(f"updated {args.readme}")


def describe_machine(args: argparse.Namespace, nthreads: int) -> dict[str, Any]:
    import torch

    machine = machine_info()
    machine.update(
        lscpu=lscpu(),
        openblas_coretype=os.environ.get("OPENBLAS_CORETYPE"),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        torch_threads=nthreads,
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        loadavg_start=loadavg(),
        weights="one copy (in cache)" if args.in_cache else f"{args.set_mb} MB of copies, cycled",
        command="python " + " ".join(shlex.quote(a) for a in sys.argv),
    )
    return machine


def main() -> int:
    args = parse_args()
    # Build the kernel into a fresh cache dir so the compile time is measured.
    cache = tempfile.mkdtemp(prefix="hetquant-bench-cache-")
    os.environ["HETQUANT_CACHE_DIR"] = cache
    import torch

    from hetquant.runtime.kernels import int4_gemv as G

    if args.threads:
        torch.set_num_threads(args.threads)
    nthreads = torch.get_num_threads()
    t0 = time.perf_counter()
    info = G.native_info()
    first_use_s = time.perf_counter() - t0
    if not info["available"]:
        print(f"native kernel unavailable: {info['error']}", file=sys.stderr)
    machine = describe_machine(args, nthreads)
    print(f"torch {torch.__version__}, {nthreads} threads, load {machine['loadavg_start']}")
    print(f"native: {info}  (first use {first_use_s:.2f} s)")

    threads = sorted({1, nthreads})
    timer = Timer()
    g = torch.Generator().manual_seed(0)
    buf = torch.ones(GiB // 4, dtype=torch.float32)  # the bandwidth buffers
    dst = torch.empty_like(buf)
    data = make_weights(args, g)  # cycled through a set larger than the caches
    spot_check(G, data, g)
    work = Path(args.work or tempfile.mkdtemp(prefix="hetquant-bench-"))
    pools = open_pools(args, work, nthreads)
    xs = {b: {n: torch.randn(b, d["k"], generator=g) for n, d in data.items()} for b in (1, 8)}
    for b in args.batches:
        xs.setdefault(b, {n: torch.randn(b, d["k"], generator=g) for n, d in data.items()})

    for rep in range(args.repeats):
        for th in threads:
            torch.set_num_threads(th)
            timer.run(f"bw/read/{th}t", lambda i: buf.sum(), 1, buf.numel() * 4)
            timer.run(f"bw/copy/{th}t", lambda i: dst.copy_(buf), 1, 2 * buf.numel() * 4)
        torch.set_num_threads(nthreads)
        for name, d in data.items():
            for b in args.batches:
                row = (name, b, xs[b][name], d)
                if info["available"]:
                    time_native(timer, args, G, rep, threads, row)
                time_references(timer, args, G, rep, threads, row)
        time_pools(timer, pools, g)
        machine.setdefault("loadavg_repeats", []).append(loadavg())
        print(f"repeat {rep + 1}/{args.repeats} done (load {loadavg()})", flush=True)

    for _, pool in pools:
        pool.close()
    shutil.rmtree(cache, ignore_errors=True)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = loadavg()
    doc = {"machine": machine, "native": {**info, "first_use_s": first_use_s}}
    doc |= summarize(timer, args, nthreads)
    doc["group_size"] = args.group_size
    doc["target_group_ratio"] = 0.9
    publish(args, doc, nthreads)
    return 0


def group_ratios(timer: Timer, res: dict[str, dict[str, Any]], kind: str = "group") -> None:
    """For every ``kind`` row (group-wise, or the token-blocked ``gemm`` order): its weight GB/s
    over the baseline row's (per-channel; the plain order), per repeat (the two ran back to
    back), as median / min / max, and the ratio of the medians."""
    for k, v in res.items():
        parts = k.split("/")
        if len(parts) != 4 or f"_{kind}" not in parts[2]:
            continue
        prec = parts[2].rsplit("_", 1)[1]
        base = "_plain" if kind == "gemm" else ""
        pc = f"{parts[0]}/{parts[1]}/int4_native{base}_{prec}/{parts[3]}"
        g_rate = [v["bytes"] / t for t in timer.samples[k]]
        pc_rate = [res[pc]["bytes"] / t for t in timer.samples[pc]]
        ratios = sorted(a / b for a, b in zip(g_rate, pc_rate, strict=True))
        v["ratio_vs_per_channel"] = {
            "median": median(ratios),
            "min": ratios[0],
            "max": ratios[-1],
            "of_medians": v["gbps"] / res[pc]["gbps"],
            "of_best": max(g_rate) / max(pc_rate),  # fastest samples: least disturbed
            "time_ratio_of_medians": res[pc]["ms"] / v["ms"],
        }
        if parts[3] == "1t":  # one thread: the calling thread's CPU time too (immune to waiting)
            cpu = [
                (v["bytes"] / g) / (res[pc]["bytes"] / p)
                for g, p in zip(timer.cpu[k], timer.cpu[pc], strict=True)
                if g > 0 and p > 0
            ]
            v["ratio_vs_per_channel"]["cpu_time_median"] = median(cpu) if cpu else None


def render_group(doc: dict[str, Any], gemm: bool = False) -> str:
    m = doc["machine"]
    cpu = m.get("lscpu", {})
    res = doc["results"]
    bw = doc["bandwidth_gbps"]
    nat = doc["native"]
    lines = [
        f"Run {m['date']} · `{m['command']}` · {cpu.get('Model name', m.get('cpu_model'))}, "
        f"{cpu.get('CPU(s)', m.get('nproc'))} CPUs (L3 {cpu.get('L3', '?')}, {cpu.get('isa', '')}"
        f"{', ' + cpu['hypervisor'] + ' VM' if cpu.get('hypervisor') else ''}) · torch "
        f"{m['torch']} · weights: {m.get('weights', 'cycled')} · load average "
        f"{m['loadavg_start']} → {m['loadavg_end']} · native kernel "
        f"`{nat.get('isa')}` · read bandwidth {bw['read']:.1f} GB/s (1 thread by CPU time "
        f"{bw.get('read_1t_cpu_time') or 0:.1f})",
        "",
        f"| shape | batch | precision | threads | {'plain order' if gemm else 'per-channel'} GB/s | "
        f"{'token-blocked' if gemm else 'group-' + str(doc['group_size'])} GB/s | ratio (median of repeats) | min – max | ratio of best samples | time ratio "
        "| ratio by CPU time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, v in res.items():
        r = v.get("ratio_vs_per_channel")
        if r is None:
            continue
        shape, b, method, th = k.split("/")
        n, kk = SHAPES[shape]
        prec = method.rsplit("_", 1)[1]
        pc = res[f"{shape}/{b}/int4_native{'_plain' if gemm else ''}_{prec}/{th}"]
        lines.append(
            f"| {shape} [{n}, {kk}] | {b[1:]} | {prec} | {th[:-1]} | {pc['gbps']:.2f} | "
            f"{v['gbps']:.2f} | **{r['median']:.2f}** | {r['min']:.2f} – {r['max']:.2f} | "
            f"{r['of_best']:.2f} | "
            f"{r['time_ratio_of_medians']:.2f} | "
            f"{'' if r.get('cpu_time_median') is None else format(r['cpu_time_median'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def render(doc: dict[str, Any], nthreads: int) -> str:
    m = doc["machine"]
    cpu = m.get("lscpu", {})
    res = doc["results"]
    bw = doc["bandwidth_gbps"]
    nat = doc["native"]
    lines = [
        f"Run {m['date']} · `{m['command']}` · {cpu.get('Model name', m.get('cpu_model'))}, "
        f"{cpu.get('CPU(s)', m.get('nproc'))} CPUs ({cpu.get('Thread(s) per core', '?')} "
        f"thread/core, L3 {cpu.get('L3', '?')}, {cpu.get('isa', '')}"
        f"{', ' + cpu['hypervisor'] + ' VM' if cpu.get('hypervisor') else ''}) · torch "
        f"{m['torch']} ({m['torch_threads']} threads, OPENBLAS_CORETYPE="
        f"{m.get('openblas_coretype')}) · load average {m['loadavg_start']} → {m['loadavg_end']}",
        "",
        f"Native kernel: `{nat.get('isa')}`, built in {nat.get('compile_s') or 0:.1f} s "
        f"(first use {nat.get('first_use_s', 0):.1f} s).",
        "",
        f"Memory bandwidth (1 GiB buffer, median): read (sum) {bw['read']:.1f} GB/s, copy "
        f"(read + write) {bw['copy']:.1f} GB/s; reference = {bw['reference']:.1f} GB/s. "
        f"One thread by CPU time: read {bw.get('read_1t_cpu_time') or 0:.1f} GB/s.",
        "",
        "| shape | batch | method | threads | ms / call | weight GB/s | % of bandwidth | vs bf16 "
        "| 1 thread, CPU time: GB/s (% of read) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, v in res.items():
        parts = k.split("/")
        if len(parts) != 4 or parts[0] not in SHAPES:
            continue
        shape, b, method, th = parts
        n, kk = SHAPES[shape]
        cpu = (
            f"{v['cpu_gbps']:.2f} ({v['cpu_pct_of_bandwidth']:.0f}%)"
            if v.get("cpu_pct_of_bandwidth")
            else ""
        )
        lines.append(
            f"| {shape} [{n}, {kk}] | {b[1:]} | {method} | {th[:-1]} | {v['ms']:.3f} | "
            f"{v['gbps']:.2f} | {v['pct_of_bandwidth']:.0f}% | "
            f"{v.get('speedup_vs_bf16', 0):.2f}× | {cpu} |"
        )
    pool_rows = [(k, v) for k, v in res.items() if k.startswith("pool/")]
    if pool_rows:
        lines += [
            "",
            "`CpuExpertPool.forward`, one token, top-8 of 16 DeepSeek-size experts (bf16 in/out, "
            "176 MB of INT4 per call):",
            "",
            "| subpools | kernel threads per subpool | ms / token·layer | weight GB/s "
            "| % of bandwidth |",
            "|---|---|---|---|---|",
        ]
        for k, v in pool_rows:
            sp, th = k.split("/")[-2:]
            lines.append(
                f"| {sp[1:]} | {th[:-1]} | {v['ms']:.2f} | {v['gbps']:.2f} | "
                f"{v['pct_of_bandwidth']:.0f}% |"
            )
    return "\n".join(lines) + "\n"


def update_readme(path: Path, table: str) -> None:
    """Replace the text between the markers, or append the section; other sections untouched."""
    if replace_marked(path, START, END, table):
        return
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n`python benchmarks/bench_expert_gemv.py`\n"
    text = text.rstrip("\n") + "\n\n" + f"{START}\n{table}{END}\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
