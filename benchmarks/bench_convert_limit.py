"""Every recipe against the machine's limit, on a source shaped like the real one (issue 30).

The source: ``make_synthetic.py`` with ``--moe-layers N`` real-shape DeepSeek MoE layers (256
experts by default, hidden 7168, intermediate 2048, FP8 with 128x128 scales) after one dense
layer, one shard per layer (as DeepSeek's own checkpoint is cut), written to ``--source-dir``
(kept: the next run reuses it). Per recipe and worker count (default 1, 16 and all cores), one
``hetquant convert -v`` each, page cache warm, outputs in ``--work``; measured per run:

* wall, CPU, source GB/s, peak ΣPss_Anon / source; the engine's phases (``timings``): start-up,
  plan, preparation, **jobs**, the **hash tail** (after the last job: hashing what the hashing
  threads had not followed), build, move-in; the **longest serial phase** (the longest of those
  but the jobs) and its share of the wall — not the hash tail where the disks took the bytes
  written after the jobs at ≥ 0.8 × the limit's write rate (``tail_disk_over_limit``): that tail
  is the fsync of dirty pages at the storage's speed, not one core working; the longest run of
  ≤ 1.5 busy cores (``/proc/stat``);
* the **limit**, measured in the same run right after the conversion: every source file read
  once (warm, ``--threads`` threads over 256 MB ranges) plus an output of the artifact's file
  sizes written once on the same storage (``pwrite`` of random bytes, one thread per file up to
  the cores, each file fsynced: the time includes the fsync); **wall / limit** (issue 30's
  target: limit ≥ 0.8 × wall, i.e. wall / limit ≤ 1.25);
* the extrapolation to DeepSeek-R1 (688.6 GB of source): R1's own start-up + the rest × 688.6 GB /
  source bytes, where R1's start-up (interpreter, imports, reading and checking its 163 headers,
  planning its 91,991 tensors) is measured per recipe by ``--dry-run`` on the real layout
  (``examples/deepseek-v3-layout``, data as sparse holes) — the one-layer source's start-up would
  hide that it grows with the tensors; and fp4's jobs / awq-w4a16's jobs at each worker count.

Prints a compact table and writes ``benchmarks/results/bench_convert_limit.json`` (``--json``).
A smoke test here: ``--moe-layers 1 --experts 16 --workers 1 2``; on a 16-32 core host:

    python benchmarks/bench_convert_limit.py --moe-layers 2 --source-dir /tmp/hq-src --work /dev/shm/hq-out
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_synthetic  # noqa: E402
from _measure import machine_info, run_measured, warm_page_cache, write_result  # noqa: E402
from bench_convert_bf16 import HETQUANT  # noqa: E402
from bench_convert_scaling import BUILD_KERNELS, COMPILE_DEPS, STARTUP, _summarize  # noqa: E402
from dry_run_671b import load_make_layout  # noqa: E402

from hetquant.convert.fs.mounts import memory_backed  # noqa: E402

RESULT = HERE / "results" / "bench_convert_limit.json"
RECIPES = ("bf16", "ascend-hybrid", "ascend-w8a8", "awq-w4a16", "fp4")
R1_SOURCE_BYTES = 688.6e9  # DeepSeek-R1's FP8 checkpoint
SERIAL_PHASES = ("startup_s", "plan_s", "prepare_s", "hash_tail_s", "build_s", "move_in_s")
RANGE = 256 << 20  # bytes per read task of the limit's read
WRITE_BLOCK = 64 << 20


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def make_source(args: argparse.Namespace) -> Path:
    """The synthetic source (generated unless current), written back, kernels built."""
    src: Path = args.source_dir / f"synthetic-e{args.experts}-m{args.moe_layers}"
    if not make_synthetic.is_current(src, args.experts, 1024, 0, 1, args.moe_layers):
        print(f"generating {src} ({args.moe_layers} MoE layers, {args.experts} experts) …")
        shutil.rmtree(src, ignore_errors=True)
        make_synthetic.write_checkpoint(
            src, args.experts, jobs=cores(), moe_layers=args.moe_layers, quiet=True
        )
    os.sync()  # nothing of the generation may be written back under a timed run
    subprocess.run([sys.executable, "-c", BUILD_KERNELS], check=True)
    return src


def _read_range(path: Path, start: int, size: int) -> int:
    buf = bytearray(8 << 20)
    view, done = memoryview(buf), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < size:
            n = os.preadv(fd, [view[: min(len(buf), size - done)]], start + done)
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return done


def read_seconds(shards: list[Path], threads: int) -> float:
    """Every byte of ``shards`` read once, ``threads`` at a time over ``RANGE``-byte ranges."""
    tasks = [(p, o, min(RANGE, p.stat().st_size - o)) for p in shards
             for o in range(0, p.stat().st_size, RANGE)]  # fmt: skip
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(lambda t: _read_range(*t), tasks))
    dt = time.perf_counter() - t0
    assert total == sum(p.stat().st_size for p in shards)
    return dt


def _write_file(path: Path, size: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, len(block)):
            os.pwrite(fd, block[: min(len(block), size - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_seconds(where: Path, sizes: list[int], threads: int) -> float:
    """Files of ``sizes`` written once into ``where`` (random bytes, each fsynced), ``threads``
    files at a time; removed afterwards (untimed)."""
    where.mkdir(parents=True, exist_ok=True)
    block = os.urandom(WRITE_BLOCK)
    paths = [where / f"limit-{i:05d}.bin" for i in range(len(sizes))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(threads, len(sizes)))) as ex:
        list(ex.map(lambda a: _write_file(a[0], a[1], block), zip(paths, sizes, strict=True)))
    dt = time.perf_counter() - t0
    shutil.rmtree(where)
    return dt


def warm_memory(src: Path, args: argparse.Namespace) -> None:
    """Where the outputs go to memory (tmpfs), write and remove twice the source there once,
    untimed. Each run measures its conversion before its limit, so on a fresh (virtual) machine
    the first conversion alone would pay the first touch of that memory (the seventh round's
    guess for a first recipe at up to 1.6x its later CPU; in the eighth, that tree's bf16 cost
    as much in every round, so the guess explains it not always)."""
    args.work.mkdir(parents=True, exist_ok=True)
    if not memory_backed(args.work):
        return
    total = 2 * sum(p.stat().st_size for p in src.glob("*.safetensors"))
    files = max(1, args.threads)
    write_seconds(args.work / "warm", [total // files] * files, args.threads)


def convert_once(src: Path, out: Path, recipe: str, workers: int, args: argparse.Namespace, r1_start: float) -> dict[str, Any]:  # fmt: skip
    """One conversion measured, then the limit for its output measured on the same storage."""
    shutil.rmtree(out, ignore_errors=True)
    shards = sorted(src.glob("*.safetensors"))
    warm_page_cache(shards)
    os.sync()
    source_bytes = sum(p.stat().st_size for p in shards)
    cmd = [sys.executable, "-c", HETQUANT, "-v", "convert", str(src), str(out),
           "--recipe", recipe, "--workers", str(workers)]  # fmt: skip
    t_popen = time.time()
    r = run_measured(cmd, pss_every=5, cpu_interval=0.25)
    s = _summarize(r, source_bytes, t_popen)
    s.update(disk_traffic(r.get("io_trace", []), s.get("phases", {})))
    sizes = [p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()]
    shutil.rmtree(out)
    warm_page_cache(shards)
    s["read_s"] = read_seconds(shards, args.threads)
    s["write_s"] = write_seconds(args.work / "limit", sizes, args.threads)
    s.update(recipe=recipe, workers=workers, source_bytes=source_bytes, output_bytes=sum(sizes),
             r1_startup_s=r1_start)  # fmt: skip
    return derive(s)


def disk_traffic(trace: list[tuple[float, float, float, float]], ph: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """From ``/proc/vmstat`` samples (seconds, dirty MB, write-back MB, MB/s to the disks): the
    GB the disks took before the jobs began, during them and after them, the peak dirty GB, and
    the sampled series (``t:dirty:writeback:rate``) — whether the disk worked while jobs ran."""
    if not trace or "jobs_s" not in ph:
        return {}
    begin = ph.get("startup_s", 0) + ph.get("plan_s", 0) + ph.get("prepare_s", 0)
    end = begin + ph["jobs_s"]
    gb = {"before": 0.0, "during": 0.0, "after": 0.0}
    prev = 0.0
    for t, _, _, rate in trace:
        part = "before" if t <= begin else "during" if t <= end else "after"
        gb[part] += rate * (t - prev) / 1e3
        prev = t
    return {
        **{f"disk_gb_{k}_jobs": round(v, 2) for k, v in gb.items()},
        "peak_dirty_gb": round(max(d for _, d, _, _ in trace) / 1e3, 2),
        "io_trace": " ".join(f"{t:g}:{d:g}:{w:g}:{r:g}" for t, d, w, r in trace),
    }


def r1_startup(layout: Path, recipe: str) -> float:
    """Seconds from launch until DeepSeek-R1's plan is made (``--dry-run`` on its layout)."""
    cmd = [sys.executable, "-c", HETQUANT, "-v", "convert", str(layout), str(layout.parent / "out"),
           "--recipe", recipe, "--dry-run"]  # fmt: skip
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(STARTUP.findall(res.stderr)[-1])["planned"] - t0


def derive(s: dict[str, Any]) -> dict[str, Any]:
    """The figures of the table from one run's measurements."""
    ph = s.get("phases", {})
    serial = {k: ph[k] for k in SERIAL_PHASES if k in ph}
    tail = ph.get("hash_tail_s", 0.0)
    if tail > 0 and "disk_gb_after_jobs" in s:  # GB/s the disks took after the jobs / the limit's
        s["tail_disk_over_limit"] = s["disk_gb_after_jobs"] / tail / (s["output_bytes"] / 1e9 / s["write_s"])  # fmt: skip
        if s["tail_disk_over_limit"] >= 0.8:
            serial.pop("hash_tail_s")
    name, longest = max(serial.items(), key=lambda kv: kv[1]) if serial else ("?", 0.0)
    s["limit_s"] = s["read_s"] + s["write_s"]
    s["wall_over_limit"] = s["wall_s"] / s["limit_s"]
    s["longest_phase"], s["longest_phase_s"] = name, longest
    s["longest_phase_share"] = longest / s["wall_s"]
    startup = ph.get("startup_s", 0.0)
    scale = R1_SOURCE_BYTES / s["source_bytes"]
    r1_start = s.get("r1_startup_s", startup)
    s["r1_extrapolated_s"] = r1_start + (s["wall_s"] - startup) * scale
    s["r1_startup_share"] = r1_start / s["r1_extrapolated_s"]
    return s


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'recipe':<14}{'w':>4}{'wall':>8}{'jobs':>7}{'tail':>6}{'longest serial':>22}"
            f"{'read+write':>12}{'wall/lim':>9}{'R1 (688.6 GB)':>15}{'R1 start':>9}")  # fmt: skip
    lines = [head]
    for s in rows:
        ph = s.get("phases", {})
        lines.append(
            f"{s['recipe']:<14}{s['workers']:>4}{s['wall_s']:>7.2f}s{ph.get('jobs_s', 0):>6.2f}s"
            f"{ph.get('hash_tail_s', 0):>5.2f}s {s['longest_phase']:>11} {s['longest_phase_s']:5.2f}s"
            f" {100 * s['longest_phase_share']:3.0f}% {s['read_s']:5.2f}+{s['write_s']:<5.2f}"
            f"{s['wall_over_limit']:>8.2f} {s['r1_extrapolated_s'] / 60:>10.1f} min"
            f" {100 * s['r1_startup_share']:5.1f}%"
        )
    return "\n".join(lines)


def fp4_over_awq(rows: list[dict[str, Any]]) -> dict[int, float]:
    """fp4's jobs phase / awq-w4a16's, per worker count (the quantizer target: ≤ 1.3)."""
    jobs = {(s["recipe"], s["workers"]): s.get("phases", {}).get("jobs_s") for s in rows}
    return {w: jobs[("fp4", w)] / jobs[("awq-w4a16", w)] for (r, w) in jobs
            if r == "fp4" and jobs.get(("awq-w4a16", w))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--source-dir", type=Path, default=Path("/tmp/hetquant-limit-src"))
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/hetquant-limit-out"))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--workers", type=int, nargs="+", default=sorted({1, min(16, cores()), cores()}))  # fmt: skip
    ap.add_argument(
        "--threads", type=int, default=cores(), help="threads of the limit's read/write"
    )
    ap.add_argument(
        "--compile-deps", action="store_true",
        help="first write the bytecode of the third-party packages a conversion imports, in "
        "place, as pip install does (hosts whose venv lacks it compile numpy in every run)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=RESULT)
    args = ap.parse_args()
    src = make_source(args)
    if args.compile_deps:
        subprocess.run([sys.executable, "-c", COMPILE_DEPS], check=True)
    warm_memory(src, args)
    with tempfile.TemporaryDirectory() as tmp:
        layout = load_make_layout().write_layout(Path(tmp) / "DeepSeek-R1")
        r1_start = {r: min(r1_startup(layout, r) for _ in range(2)) for r in args.recipes}
    print("DeepSeek-R1 start-up (s):", {r: round(v, 2) for r, v in r1_start.items()})
    rows = []
    for workers in args.workers:
        for recipe in args.recipes:
            out = args.work / f"{recipe}-w{workers}"
            rows.append(convert_once(src, out, recipe, workers, args, r1_start[recipe]))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if "disk_gb_during_jobs" in rows[-1]:
                print("   disk GB before/during/after jobs, peak dirty:",
                      *(rows[-1][f"disk_gb_{k}_jobs"] for k in ("before", "during", "after")),
                      rows[-1]["peak_dirty_gb"], flush=True)  # fmt: skip
    shutil.rmtree(args.work, ignore_errors=True)
    print(f"\n{src}: {rows[0]['source_bytes'] / 1e9:.2f} GB, {cores()} cores\n{table(rows)}")
    ratio = fp4_over_awq(rows)
    print("fp4 jobs / awq-w4a16 jobs:", {w: round(v, 2) for w, v in ratio.items()})
    for s in rows:
        s.pop("busy_cores_trace", None)
    doc = {"benchmark": "bench_convert_limit", "machine": machine_info(), "cores": cores(),
           "moe_layers": args.moe_layers, "experts": args.experts, "runs": rows,
           "compiled_deps": args.compile_deps,
           "fp4_over_awq_jobs": ratio}  # fmt: skip
    write_result(args.json, doc)


if __name__ == "__main__":
    main()
