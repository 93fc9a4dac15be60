"""Convert throughput over cores, with DeepSeek's fp8_cast_bf16 as the baseline (issue #16).

In ONE run, on synthetic DeepSeek-V3 checkpoints at real shapes (``make_synthetic.py``), each
measurement ``--repeats`` times, interleaved (every configuration once per round), medians:

* **many cores** — source: one dense + one MoE layer with ``--experts`` routed experts (256: 11.9
  GB, the issue's table). ``raw`` (every source byte read: the I/O floor); ``hetquant convert
  --recipe bf16`` at ``--workers`` 1, 4, 8, 16 (those up to ``--max-workers``, default
  min(16, cores), plus the max); ``ascend-hybrid``, ``ascend-w8a8``, ``awq-w4a16`` and ``fp4`` at
  the max; the **naive** port of DeepSeek's ``inference/fp8_cast_bf16.py`` (re-implemented here:
  per source shard ``load_file``, every FP8 weight ``(w.float() * s)`` with the 128×128 scales
  expanded, cast to BF16, ``save_file``; the scale tensors dropped and the index rewritten) on the
  CPU with torch's threads = max workers, and on the GPU (``load_file(device="cuda")``, as the
  script does; the Triton ``weight_dequant`` replaced by the same torch arithmetic) when CUDA is
  present.
* **two cores** — source: one MoE layer of 16 experts (0.97 GB, ``--dense-layers 0``); both
  processes pinned to two CPUs (``sched_setaffinity``): ``bf16 --workers 2`` against the naive port
  with 2 threads (issue target: ≤ 0.25× its time).

Per run: wall time (process start to exit), CPU time, source GB/s, peak anonymous memory of the
process tree both as the sum of ``RssAnon`` (counts a forked worker's copy-on-write pages once per
process) and as the sum of ``Pss_Anon`` (each shared page once: the memory really used), over the
source size; busy cores machine-wide from ``/proc/stat`` every 0.25 s, and from them the
**serial** seconds (≤ 1.5 cores busy) and the longest serial stretch; the engine's own phase
timings (``hetquant -v`` logs them: start-up until the engine is entered — interpreter, imports,
source headers —, plan, preparation, workers ready, jobs, the hashing tail, build, move). The
page cache holds the source before every run (read untimed, ``sync``); outputs go to
``--work``, default ``/dev/shm`` (tmpfs, as the issue measured) when it has room. Output bytes:
the bf16 artifact at the max worker count is compared tensor by tensor with the naive CPU
output. Raw numbers: ``benchmarks/results/bench_convert_scaling.json``.

Usage::

    python benchmarks/bench_convert_scaling.py                  # 256 experts: ~5-8 min on 16 cores
    python benchmarks/bench_convert_scaling.py --experts 16 --max-workers 2   # a small machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_synthetic  # noqa: E402
from _measure import machine_info, median, run_measured, warm_page_cache, write_result  # noqa: E402
from bench_convert_bf16 import HETQUANT, INDEX, RAW_READ  # noqa: E402

RESULT = HERE / "results" / "bench_convert_scaling.json"
RECIPES = ("ascend-hybrid", "ascend-w8a8", "awq-w4a16", "fp4")
SERIAL_CORES = 1.5  # busy cores at or below which a sample counts as serial
TIMINGS = re.compile(r"hetquant\.convert: timings (\{.*\})")
STARTUP = re.compile(r"hetquant: start-up (\{.*\})")
TARGETS = {
    "bf16_gbps_max": 2.0,
    "scaling_1_to_max": 10.0,
    "serial_fraction": 0.10,
    "workers_ready_s": 2.0,
    "bf16_w1_gbps": 0.4,
    "pss_over_source": 0.2,
    "two_core_over_naive": 0.25,
}


# ------------------------------------------------------------------------------------------------
# the naive baseline: `bench_convert_scaling.py --naive SRC OUT DEVICE`


def naive_fp8_cast_bf16(src: Path, out: Path, device: str) -> None:
    """DeepSeek's fp8_cast_bf16 (see module docstring), on ``device``."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.set_default_dtype(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    loaded: dict[str, dict[str, torch.Tensor]] = {}

    def tensor(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in loaded:
            loaded[file] = load_file(src / file, device=device)
        return loaded[file][name]

    dropped = []
    for file in sorted(set(weight_map.values())):
        state = loaded[file] = loaded.get(file) or load_file(src / file, device=device)
        result = {}
        for name, w in state.items():
            if name.endswith("_scale_inv"):
                continue
            if w.element_size() == 1:
                s = tensor(f"{name}_scale_inv")
                m, n = w.shape
                s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :n]  # (m, n)
                result[name] = (w.to(torch.float32) * s).to(torch.bfloat16)
                dropped.append(f"{name}_scale_inv")
            else:
                result[name] = w
        save_file(result, out / file, metadata={"format": "pt"})
        del result
        while len(loaded) > 2:
            del loaded[next(iter(loaded))]
    for name in dropped:
        weight_map.pop(name, None)
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def compare_dirs(ours: Path, naive: Path) -> dict[str, Any]:
    """Tensor by tensor (names, dtypes, shapes, bytes) through both indexes."""
    import torch
    from safetensors import safe_open

    a_map = json.loads((ours / INDEX).read_text())["weight_map"]
    b_map = json.loads((naive / INDEX).read_text())["weight_map"]
    problems = [
        f"{n}: only in {'ours' if n in a_map else 'naive'}" for n in sorted(set(a_map) ^ set(b_map))
    ]
    opened: dict[Path, Any] = {}

    def get(root: Path, file: str, name: str) -> torch.Tensor:
        if root / file not in opened:
            opened[root / file] = safe_open(root / file, "pt").__enter__()
        return opened[root / file].get_tensor(name)

    for name in sorted(set(a_map) & set(b_map)):
        x, y = get(ours, a_map[name], name), get(naive, b_map[name], name)
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        ):
            problems.append(f"{name}: differs")
    for h in opened.values():
        h.__exit__(None, None, None)
    return {
        "pass": not problems,
        "tensors": len(set(a_map) & set(b_map)),
        "problems": problems[:20],
    }


# ------------------------------------------------------------------------------------------------
# runs


def _source(work: Path, experts: int, dense: int, jobs: int) -> Path:
    src = work / f"synthetic-e{experts}-d{dense}"
    if not make_synthetic.is_current(src, experts, 1024, 0, dense):
        print(f"generating {src} ({jobs} processes) …", flush=True)
        shutil.rmtree(src, ignore_errors=True)
        make_synthetic.write_checkpoint(src, experts, dense_layers=dense, jobs=jobs)
    # Nothing one-off may fall into the first timed run (`bf16 w1`: 26-30 s instead of 14 s on a
    # fresh H100 host, 2026-11-24): the write-back of a source just written, and the build of
    # the conversion kernels into an empty cache (~9 s at one core; once per machine).
    os.sync()
    subprocess.run([sys.executable, "-c", BUILD_KERNELS], check=True)
    return src


def _pin(cpus: set[int] | None) -> Any:
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def _summarize(r: dict[str, Any], source_bytes: int, t_popen: float) -> dict[str, Any]:
    trace = r.pop("busy_cores_trace", [])
    out = {k: r[k] for k in ("wall_s", "peak_anon_bytes") if k in r}
    out["cpu_s"] = r["cpu_user_s"] + r["cpu_sys_s"]
    out["source_gbps"] = source_bytes / 1e9 / r["wall_s"]
    out["peak_pss_anon_bytes"] = r.get("peak_pss_anon_bytes")
    out["pss_over_source"] = (r.get("peak_pss_anon_bytes") or 0) / source_bytes
    out["anon_over_source"] = r["peak_anon_bytes"] / source_bytes
    serial, longest, run_len, prev = 0.0, 0.0, 0.0, 0.0
    for t, busy in trace:
        dt, prev = t - prev, t
        if busy <= SERIAL_CORES:
            serial, run_len = serial + dt, run_len + dt
            longest = max(longest, run_len)
        else:
            run_len = 0.0
    out["serial_s"], out["longest_serial_s"] = round(serial, 2), round(longest, 2)
    out["serial_fraction"] = serial / r["wall_s"]
    out["mean_busy_cores"] = round(sum(b for _, b in trace) / len(trace), 2) if trace else None
    out["busy_cores_trace"] = " ".join(f"{t:g}:{b:g}" for t, b in trace)  # seconds:busy cores
    found = TIMINGS.findall(r.get("stderr", ""))
    if found:
        t = json.loads(found[-1])
        t["startup_s"] = round(t.pop("entered") - t_popen, 3)  # interpreter, imports, headers
        if marks := STARTUP.findall(r.get("stderr", "")):  # the start-up's parts
            m = json.loads(marks[-1])
            t["imports_s"] = round(m["called"] - t_popen, 3)  # interpreter + imports + click
            t["open_s"] = round(m["opened"] - m["called"], 3)  # headers, role table, checks
            t["planning_s"] = round(m["planned"] - m["opened"], 3)
        t["prepare_s"] = round(t.pop("jobs_started") - t_popen - t["startup_s"] - t["plan_s"], 3)
        out["phases"] = t
    return out


def _measure(
    name: str,
    cmd: list[str],
    src: Path,
    out: Path | None,
    pin: set[int] | None,
    env: dict[str, str],
) -> dict[str, Any]:
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    shards = sorted(src.glob("*.safetensors"))
    warm_page_cache(shards)
    os.sync()
    source_bytes = sum(p.stat().st_size for p in shards)
    t_popen = time.time()
    r = run_measured(cmd, env=env, pss_every=5, cpu_interval=0.25, preexec_fn=_pin(pin))
    s = _summarize(r, source_bytes, t_popen)
    ph = s.get("phases", {})
    print(
        f"  {name:<34} {s['wall_s']:7.2f} s  {s['source_gbps']:6.3f} GB/s  cpu {s['cpu_s']:7.1f} s  "
        f"pss {s['pss_over_source']:.3f}× src  serial {s['serial_s']:.1f} s"
        + (f"  ready {ph['workers_ready_s']:.2f} s" if "workers_ready_s" in ph else ""),
        flush=True,
    )
    return s


CONVERT_ARGS: list[str] = []  # --convert-args
# Every C++ library a conversion loads, built (cached) before the timed runs.
# the native kernels built, and hetquant's bytecode written the way a pip install writes it: with
# PYTHONDONTWRITEBYTECODE set (the device machines set it) a checkout otherwise compiles every
# module in every run, 0.5-0.7 s of "start-up" that no installed copy pays
BUILD_KERNELS = (
    "import compileall, importlib; from hetquant.formats import _quant_native as q, blake3_tree"
    " as b; q.available(); b.available(); [compileall.compile_dir(importlib.import_module("
    "'hetquant.' + m).__path__[0], quiet=1) for m in ('formats', 'convert', 'calib', 'runtime')]"
)

# `--compile-deps`: the bytecode of every third-party package a conversion imports (numpy, click,
# …), written into the packages' own `__pycache__` as `pip install` does. The lent hosts' venv was
# installed without it (and sets PYTHONDONTWRITEBYTECODE), so `import numpy` compiled numpy in
# every run there: 0.21-0.31 s, against 0.10-0.12 s compiled (2026-11-28, 16-core host).
COMPILE_DEPS = (
    "import compileall, sys; from pathlib import Path; import hetquant.convert.cli, "
    "hetquant.convert.engine.native_jobs, hetquant.convert.engine.tree_hashing; "
    "tops = sorted({m.split('.')[0] "
    "for m, mod in list(sys.modules.items()) if getattr(mod, '__file__', None) and not "
    "m.startswith('hetquant') and 'site-packages' in str(Path(mod.__file__).resolve())}); "
    "dirs = [Path(sys.modules[t].__file__).parent for t in tops if "
    "getattr(sys.modules.get(t), '__file__', None) and "
    "Path(sys.modules[t].__file__).name == '__init__.py']; "
    "ok = all([compileall.compile_dir(d, quiet=1, workers=0) for d in dirs]); "
    "print('compiled the bytecode of', [d.name for d in dirs], 'ok' if ok else 'with errors')"
)


def _convert(src: Path, out: Path, recipe: str, workers: int) -> list[str]:
    args = ["convert", str(src), str(out), "--recipe", recipe, "--workers", str(workers)]
    return [sys.executable, "-c", HETQUANT, "-v", *args, *CONVERT_ARGS]


def _naive(src: Path, out: Path, device: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--naive", str(src), str(out), device]


def _configs(
    args: argparse.Namespace, src: Path, work: Path, cuda: bool
) -> dict[str, tuple[list[str], Path | None]]:
    top = args.max_workers
    counts = sorted({w for w in (1, 4, 8, 16) if w <= top} | {top})
    shards = [str(p) for p in sorted(src.glob("*.safetensors"))]
    cfgs: dict[str, tuple[list[str], Path | None]] = {
        "raw read": ([sys.executable, "-c", RAW_READ, *shards], None)
    }
    for w in counts:
        cfgs[f"bf16 w{w}"] = (
            _convert(src, work / f"ours-bf16-w{w}", "bf16", w),
            work / f"ours-bf16-w{w}",
        )
    for r in args.recipes:
        cfgs[f"{r} w{top}"] = (_convert(src, work / f"ours-{r}", r, top), work / f"ours-{r}")
    cfgs[f"naive cpu ({top} threads)"] = (
        _naive(src, work / "naive-cpu", "cpu"),
        work / "naive-cpu",
    )
    if cuda:
        cfgs["naive gpu"] = (_naive(src, work / "naive-gpu", "cuda"), work / "naive-gpu")
    return cfgs


def _section(
    title: str,
    cfgs: dict,
    src: Path,
    pin: set[int] | None,
    env: dict[str, str],
    repeats: int,
    keep: set[str],
) -> dict[str, Any]:
    print(
        f"{title}: {src} ({sum(p.stat().st_size for p in src.glob('*.safetensors')) / 1e9:.2f} GB)"
    )
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in cfgs}
    for rep in range(repeats):
        print(f" round {rep + 1}/{repeats}")
        for name, (cmd, out) in cfgs.items():
            runs[name].append(_measure(name, cmd, src, out, pin, env))
            if out is not None and name not in keep:
                shutil.rmtree(out, ignore_errors=True)
    best = {}
    for name, rs in runs.items():
        m = (
            dict(rs[0])
            if repeats == 1
            else {
                **rs[0],
                **{k: median([r[k] for r in rs]) for k in ("wall_s", "cpu_s", "source_gbps")},
            }
        )
        m["rounds_wall_s"] = [round(r["wall_s"], 3) for r in rs]
        best[name] = m
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cores = len(os.sched_getaffinity(0))
    args.max_workers = args.max_workers or min(16, cores)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.max_workers)}
    cuda = torch.cuda.is_available() and not args.no_gpu
    doc: dict[str, Any] = {
        "benchmark": "bench_convert_scaling",
        "machine": machine_info(),
        "command": " ".join(["python", "benchmarks/bench_convert_scaling.py", *sys.argv[1:]]),
        "work": str(work),
        "cores": cores,
        "max_workers": args.max_workers,
    }
    if not args.skip_many:
        src = _source(args.source_dir, args.experts, 1, cores)
        cfgs = _configs(args, src, work, cuda)
        top = f"bf16 w{args.max_workers}"
        naive = f"naive cpu ({args.max_workers} threads)"
        res = _section("many cores", cfgs, src, None, env, args.repeats, {top, naive})
        res["bf16 vs naive cpu"] = compare_dirs(
            work / f"ours-bf16-w{args.max_workers}", work / "naive-cpu"
        )
        shutil.rmtree(work / f"ours-bf16-w{args.max_workers}", ignore_errors=True)
        shutil.rmtree(work / "naive-cpu", ignore_errors=True)
        doc["many_cores"] = {
            "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
            "experts": args.experts,
            "runs": res,
        }
    if not args.skip_two:
        src = _source(args.source_dir, 16, 0, cores)
        pin = set(sorted(os.sched_getaffinity(0))[:2])
        cfgs = {
            "bf16 w2 (2 cpus)": (_convert(src, work / "two-ours", "bf16", 2), work / "two-ours"),
            "naive cpu (2 cpus)": (_naive(src, work / "two-naive", "cpu"), work / "two-naive"),
        }
        res = _section(
            "two cores", cfgs, src, pin, {**env, "OMP_NUM_THREADS": "2"}, args.repeats, set(cfgs)
        )
        res["bf16 vs naive cpu"] = compare_dirs(work / "two-ours", work / "two-naive")
        for d in ("two-ours", "two-naive"):
            shutil.rmtree(work / d, ignore_errors=True)
        doc["two_cores"] = {
            "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
            "cpus": sorted(pin),
            "runs": res,
        }
    doc["ratios"] = ratios(doc)
    return doc


# ------------------------------------------------------------------------------------------------
# ratios, table, main


def ratios(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    many = doc.get("many_cores", {}).get("runs", {})
    top = doc["max_workers"]
    ours = {k: v for k, v in many.items() if " w" in k and "wall_s" in v}
    if f"bf16 w{top}" in many and "bf16 w1" in many:
        b_top, b1 = many[f"bf16 w{top}"], many["bf16 w1"]
        out["bf16_gbps_max"] = b_top["source_gbps"]
        out["bf16_w1_gbps"] = b1["source_gbps"]
        out["scaling_1_to_max"] = b1["wall_s"] / b_top["wall_s"]
        for naive in [k for k in many if k.startswith("naive")]:
            out[f"bf16_w{top}_time_over_{naive.split(' (')[0].replace(' ', '_')}"] = (
                b_top["wall_s"] / many[naive]["wall_s"]
            )
    if ours:
        out["serial_fraction"] = max(v["serial_fraction"] for v in ours.values())
        out["longest_serial_s"] = max(v["longest_serial_s"] for v in ours.values())
        out["pss_over_source"] = max(v["pss_over_source"] for v in ours.values())
        ready = [
            v["phases"]["workers_ready_s"]
            for v in ours.values()
            if "workers_ready_s" in v.get("phases", {})
        ]
        out["workers_ready_s"] = max(ready) if ready else None
        out["recipes_gbps_max"] = {
            k: v["source_gbps"] for k, v in ours.items() if not k.startswith("bf16")
        }
    two = doc.get("two_cores", {}).get("runs", {})
    if "bf16 w2 (2 cpus)" in two:
        out["two_core_over_naive"] = (
            two["bf16 w2 (2 cpus)"]["wall_s"] / two["naive cpu (2 cpus)"]["wall_s"]
        )
    met = {}
    for k, tgt in TARGETS.items():
        v = out.get(k)
        if v is not None:
            low_is_good = k in (
                "serial_fraction",
                "workers_ready_s",
                "pss_over_source",
                "two_core_over_naive",
            )
            met[k] = v <= tgt if low_is_good else v >= tgt
    out["targets"], out["targets_met"] = TARGETS, met
    return out


def table(doc: dict[str, Any]) -> str:
    head = [
        "run",
        "wall",
        "CPU",
        "source GB/s",
        "serial s (longest)",
        "mean busy cores",
        "workers ready",
        "startup / plan / prepare / jobs / hash tail / build",
        "peak PSS anon / source",
        "RssAnon sum / source",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for section in ("many_cores", "two_cores"):
        for name, m in doc.get(section, {}).get("runs", {}).items():
            if "wall_s" not in m:
                continue
            ph = m.get("phases", {})
            phases = " / ".join(
                f"{ph[k]:.2f}"
                for k in ("startup_s", "plan_s", "prepare_s", "jobs_s", "hash_tail_s", "build_s")
                if k in ph
            )
            ready = (
                f"{ph['workers_ready_s']:.2f} s ({ph['start_method']})"
                if "workers_ready_s" in ph
                else ph.get("start_method", "")
            )
            lines.append(
                f"| {name} | {m['wall_s']:.2f} s | {m['cpu_s']:.1f} s | {m['source_gbps']:.3f} | "
                f"{m['serial_s']:.1f} ({m['longest_serial_s']:.1f}) | {m['mean_busy_cores']} | {ready} | {phases} | "
                f"{m['pss_over_source']:.3f} | {m['anon_over_source']:.3f} |"
            )
    r = doc["ratios"]
    lines += ["", "| figure | value | target | met |", "|---|---:|---:|:---:|"]
    for k, tgt in TARGETS.items():
        if r.get(k) is not None:
            lines.append(
                f"| {k} | {r[k]:.3f} | {tgt} | {'yes' if r['targets_met'][k] else '**no**'} |"
            )
    for k, v in r.items():
        if k.startswith("bf16_w") and "time_over" in k:
            lines.append(f"| {k} | {v:.3f} | | |")
    for sec in ("many_cores", "two_cores"):
        c = doc.get(sec, {}).get("runs", {}).get("bf16 vs naive cpu")
        if c:
            lines.append(
                f"\n{sec}: bf16 output vs naive, tensor by tensor ({c['tensors']} tensors): **{'PASS' if c['pass'] else 'FAIL'}**"
            )
    return "\n".join(lines)


def _default_work() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 64e9:
        return shm / "hetquant-scaling"
    return Path(tempfile.gettempdir()) / "hetquant-scaling"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--experts", type=int, default=256, help="routed experts of the many-core source"
    )
    ap.add_argument("--max-workers", type=int, default=0, help="default: min(16, cores)")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="outputs (default /dev/shm when roomy)")
    ap.add_argument(
        "--source-dir", type=Path, default=Path(tempfile.gettempdir()) / "hetquant-scaling-src"
    )
    ap.add_argument("--skip-many", action="store_true")
    ap.add_argument("--skip-two", action="store_true")
    ap.add_argument("--no-gpu", action="store_true", help="skip the naive GPU baseline")
    ap.add_argument(
        "--convert-args",
        default="",
        help="more options for every convert, e.g. '--max-shard-size 1GB'",
    )
    ap.add_argument("--json", type=Path, default=RESULT)
    ap.add_argument("--naive", nargs=3, metavar=("SRC", "OUT", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive:
        naive_fp8_cast_bf16(Path(args.naive[0]), Path(args.naive[1]), args.naive[2])
        return
    args.work = args.work or _default_work()
    CONVERT_ARGS.extend(args.convert_args.split())
    t0 = time.perf_counter()
    doc = run(args)
    doc["total_s"] = round(time.perf_counter() - t0, 1)
    doc["table_markdown"] = text = table(doc)
    print()
    print(text)
    print(f"\nwrote {write_result(args.json, doc)}")


if __name__ == "__main__":
    main()
