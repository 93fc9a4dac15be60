"""Benchmark of the ``bf16`` recipe against the I/O floor and a naive whole-file baseline.

On a synthetic DeepSeek-V3 checkpoint at real shapes (``make_synthetic.py``; generated into
``--source`` when absent), in ONE run, each measurement ``--repeats`` times, interleaved
(raw, ours, naive, raw, ours, naive, …), medians reported:

* **raw read** — a subprocess reads every byte of the source shards, 8 MB at a time: the I/O floor.
* **ours** — ``hetquant convert SRC OUT --recipe bf16 --workers 1`` as a subprocess (everything the
  command does: validation, streaming dequantization, ``pwrite``, fsync, sha256 of every output
  file for the manifest).
* **naive** — a subprocess (this script with ``--naive-baseline``) doing what DeepSeek's
  ``fp8_cast_bf16.py`` does, on CPU: ``safetensors.torch.load_file`` of every shard, each FP8 weight
  dequantized as ``w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :n]`` and
  cast to BF16, scales dropped, the whole result written with ``save_file``. (safetensors 0.8
  ``load_file`` maps the source lazily, so the source itself is file-backed, not anonymous, memory.)

For each: wall time (process start to exit) and peak anonymous memory — the maximum over time of
the SUM of ``RssAnon`` over the process and all its descendants, sampled every 20 ms
(``_measure.TreeMonitor``), and CPU time (user + sys, from ``wait4``). The page cache is warm for
every measurement: the source shards are read (untimed) and ``sync`` runs before each one, so the
source is resident (checked with ``mincore``; this VM's DAMON ``pageout`` scheme evicts page cache
idle for ~30 s) and no dirty pages of a previous output are being written back during it.
``--cold`` drops the page cache before each measurement instead. ``--threads N`` sets
``OMP_NUM_THREADS`` for ours and naive (default: torch's own choice, every core).

Afterwards ours and naive outputs are compared tensor by tensor (``safe_open``; names, dtypes,
shapes and bytes): PASS / FAIL. Raw numbers go to ``benchmarks/results/bench_convert_bf16.json``.

Usage::

    python benchmarks/bench_convert_bf16.py [--source DIR] [--experts 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import (  # noqa: E402
    cached_fraction,
    drop_page_cache,
    machine_info,
    median,
    run_measured,
    warm_page_cache,
    write_result,
)

DEFAULT_WORK = Path(tempfile.gettempdir()) / "hetquant-bench"
RESULT = HERE / "results" / "bench_convert_bf16.json"
INDEX = "model.safetensors.index.json"
NAIVE_OUT = "model.safetensors"
TARGETS = {"ours_peak_anon_over_source": 0.5, "ours_time_over_naive": 0.5}

RAW_READ = """
import sys, time
buf = bytearray(8 << 20); view = memoryview(buf); total = 0; t = time.perf_counter()
for p in sys.argv[1:]:
    with open(p, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
print(total, time.perf_counter() - t)
"""

HETQUANT = "import sys; from hetquant.convert.cli import main; sys.argv[0] = 'hetquant'; main()"


# ------------------------------------------------------------------------------------------------
# the naive baseline (run in a subprocess: `bench_convert_bf16.py --naive-baseline SRC OUT`)


def naive_baseline(src: Path, out: Path) -> None:
    """DeepSeek's fp8_cast_bf16, on CPU: load everything, dequantize, save everything."""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(src / f))
    result: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith("_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            m, n = w.shape
            s = state[f"{name}_scale_inv"]
            s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :n]
            result[name] = (w.to(torch.float32) * s).to(torch.bfloat16)
        else:
            result[name] = w
    save_file(result, out, metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------
# correctness


def compare_outputs(ours_dir: Path, naive_file: Path) -> dict[str, Any]:
    """Tensor-by-tensor comparison: same names, dtypes, shapes and bytes."""
    import torch
    from safetensors import safe_open

    weight_map = json.loads((ours_dir / INDEX).read_text())["weight_map"]
    problems: list[str] = []
    with safe_open(naive_file, "pt") as nf:
        naive_names = set(nf.keys())
        ours_names = set(weight_map)
        for n in sorted(naive_names ^ ours_names)[:10]:
            problems.append(f"{n}: only in {'naive' if n in naive_names else 'ours'}")
        handles: dict[str, Any] = {}
        try:
            for name in sorted(naive_names & ours_names):
                file = weight_map[name]
                if file not in handles:
                    handles[file] = safe_open(ours_dir / file, "pt").__enter__()
                a, b = handles[file].get_tensor(name), nf.get_tensor(name)
                if a.dtype != b.dtype or a.shape != b.shape:
                    problems.append(
                        f"{name}: ours {a.dtype}{list(a.shape)}, naive {b.dtype}{list(b.shape)}"
                    )
                elif not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    bad = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                    problems.append(f"{name}: {bad} byte(s) differ")
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)
    return {
        "pass": not problems,
        "tensors_compared": len(naive_names & ours_names),
        "problems": problems[:20],
    }


# ------------------------------------------------------------------------------------------------
# the benchmark


def _ensure_source(src: Path, experts: int, vocab: int, seed: int) -> None:
    import make_synthetic

    if make_synthetic.is_current(src, experts, vocab, seed):
        print(f"source: {src} (existing)")
        return
    print(f"source: generating {src} …", flush=True)
    if src.exists():
        shutil.rmtree(src)
    make_synthetic.write_checkpoint(src, experts, vocab, seed)


def _commands(src: Path, shards: list[Path], work: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "raw": [py, "-c", RAW_READ, *map(str, shards)],
        "ours": [
            py, "-c", HETQUANT, "convert", str(src), str(work / "ours"),
            "--recipe", "bf16", "--workers", "1",
        ],
        "naive": [py, str(Path(__file__).resolve()), "--naive-baseline", str(src),
                  str(work / "naive" / NAIVE_OUT)],
    }  # fmt: skip


def _reset_outputs(work: Path, which: str) -> None:
    if which == "ours":
        shutil.rmtree(work / "ours", ignore_errors=True)
    elif which == "naive":
        shutil.rmtree(work / "naive", ignore_errors=True)
        (work / "naive").mkdir(parents=True)


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _measure_rounds(
    args: argparse.Namespace,
    cmds: dict[str, list[str]],
    env: dict[str, str],
    shards: list[Path],
    order: list[str],
) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Every command of ``order`` once per round, ``--repeats`` rounds, the page cache warmed
    (or dropped, ``--cold``) before each; the runs, and how the page cache was handled."""
    work: Path = args.work.resolve()
    if args.cold:
        cache = "cold: page cache dropped before each measurement ({})"
    else:
        cache = "warm: source shards read (untimed) and sync run before each measurement"
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in order}
    for rep in range(args.repeats):
        for b in order:
            _reset_outputs(work, b)
            if args.cold:
                cache = cache.format(drop_page_cache(shards))
            else:
                warm_page_cache(shards)
            os.sync()
            resident = cached_fraction(shards)
            r = run_measured(cmds[b], env=env)
            r["source_cached_fraction_before"] = resident
            out, err = r.pop("stdout"), r.pop("stderr")
            if b == "raw":
                nbytes, inner = out.split()
                r["bytes_read"], r["inner_s"] = int(nbytes), float(inner)
            r["stdout_tail"], r["stderr_tail"] = out[-300:], err[-300:]
            r["cpu_s"] = r["cpu_user_s"] + r["cpu_sys_s"]
            runs[b].append(r)
            print(
                f"  [{rep + 1}/{args.repeats}] {b:5s} {r['wall_s']:7.2f} s wall "
                f"{r['cpu_s']:7.2f} s cpu   peak anon {_fmt_bytes(r['peak_anon_bytes']):>8s}   "
                f"({r['samples']} samples, {r['peak_processes']} process(es), "
                f"load {r['loadavg_1min_before']:.1f}, source cached {resident or 0:.0%})",
                flush=True,
            )
    return runs, cache


def _medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    keys = ("wall_s", "cpu_s", "peak_anon_bytes", "peak_file_bytes")
    return {b: {k: median([r[k] for r in rs]) for k in keys} for b, rs in runs.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    src: Path = args.source.resolve()
    _ensure_source(src, args.experts, args.vocab, args.seed)
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    shards = [src / f for f in sorted(set(weight_map.values()))]
    source_bytes = sum(p.stat().st_size for p in shards)
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < 5 * source_bytes:
        sys.exit(
            f"error: {work} has {_fmt_bytes(free)} free; needs ~{_fmt_bytes(5 * source_bytes)}"
        )
    cmds = _commands(src, shards, work)
    env = dict(os.environ)
    if args.threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(args.threads)

    order = [b for b in ("raw", "ours", "naive") if b not in args.skip]
    runs, cache = _measure_rounds(args, cmds, env, shards, order)
    summary = _medians(runs)
    ratios = _ratios(summary, source_bytes)
    check = None
    if "ours" in summary and "naive" in summary:
        print("comparing outputs tensor by tensor …", flush=True)
        check = compare_outputs(work / "ours", work / "naive" / NAIVE_OUT)
    doc = {
        "benchmark": "bench_convert_bf16",
        "machine": machine_info(),
        "command": " ".join(["python", "benchmarks/bench_convert_bf16.py", *sys.argv[1:]]),
        "source": {
            "path": str(src),
            "experts": args.experts,
            "vocab": args.vocab,
            "seed": args.seed,
            "shard_bytes": source_bytes,
            "tensors": len(weight_map),
        },
        "page_cache": cache,
        "repeats": args.repeats,
        "threads": args.threads or f"torch default ({os.cpu_count()})",
        "order": "interleaved: " + ", ".join(order) + " per round",
        "commands": cmds,
        "runs": runs,
        "median": summary,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": {
            k: (ratios[k] <= v if ratios.get(k) is not None else None) for k, v in TARGETS.items()
        },
        "correctness": check,
    }
    if not args.keep:
        shutil.rmtree(work / "ours", ignore_errors=True)
        shutil.rmtree(work / "naive", ignore_errors=True)
    return doc


def _ratios(s: dict[str, dict[str, float]], source_bytes: int) -> dict[str, float | None]:
    def get(b: str, k: str) -> float | None:
        return s[b][k] if b in s else None

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "ours_time_over_naive": div(get("ours", "wall_s"), get("naive", "wall_s")),
        "ours_cpu_over_naive_cpu": div(get("ours", "cpu_s"), get("naive", "cpu_s")),
        "ours_time_over_raw_read": div(get("ours", "wall_s"), get("raw", "wall_s")),
        "naive_time_over_raw_read": div(get("naive", "wall_s"), get("raw", "wall_s")),
        "ours_peak_anon_over_source": div(get("ours", "peak_anon_bytes"), source_bytes),
        "naive_peak_anon_over_source": div(get("naive", "peak_anon_bytes"), source_bytes),
        "ours_source_mb_per_s": div(source_bytes / 1e6, get("ours", "wall_s")),
        "naive_source_mb_per_s": div(source_bytes / 1e6, get("naive", "wall_s")),
        "raw_mb_per_s": div(source_bytes / 1e6, get("raw", "wall_s")),
    }


def table(doc: dict[str, Any]) -> str:
    """The markdown table of medians and ratios (what notes/convert-bf16.md records)."""
    s, r, src = doc["median"], doc["ratios"], doc["source"]["shard_bytes"]
    names = {"raw": "raw read (I/O floor)", "ours": "ours: `hetquant convert --recipe bf16 --workers 1`",
             "naive": "naive: load_file + repeat_interleave + save_file"}  # fmt: skip
    lines = [
        "| measurement | wall (median) | CPU user+sys (median) | source MB/s | peak RssAnon (tree) "
        "| anon / source |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for b, m in s.items():
        lines.append(
            f"| {names[b]} | {m['wall_s']:.2f} s | {m['cpu_s']:.2f} s | {src / 1e6 / m['wall_s']:.0f} | "
            f"{_fmt_bytes(m['peak_anon_bytes'])} | {m['peak_anon_bytes'] / src:.3f}× |"
        )
    lines.append("")
    lines.append("| ratio | value | target | met |")
    lines.append("|---|---:|---:|:---:|")
    labels = [
        ("ours_time_over_naive", "ours time / naive time"),
        ("ours_cpu_over_naive_cpu", "ours CPU time / naive CPU time"),
        ("ours_peak_anon_over_source", "ours peak anon / source size"),
        ("naive_peak_anon_over_source", "naive peak anon / source size"),
        ("ours_time_over_raw_read", "ours time / raw-read time"),
        ("naive_time_over_raw_read", "naive time / raw-read time"),
    ]
    for key, label in labels:
        v = r.get(key)
        if v is None:
            continue
        tgt = TARGETS.get(key)
        met = "" if tgt is None else ("yes" if v <= tgt else "**no**")
        lines.append(f"| {label} | {v:.3f} | {'≤ ' + str(tgt) if tgt else ''} | {met} |")
    c = doc.get("correctness")
    if c is not None:
        verdict = "PASS" if c["pass"] else "FAIL"
        lines.append("")
        lines.append(
            f"Correctness (ours vs naive, bit-identical tensor by tensor, {c['tensors_compared']} "
            f"tensors): **{verdict}**"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=None, help="synthetic checkpoint dir")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where outputs are written")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS for ours and naive (default: unset, torch uses every core)",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["raw", "ours", "naive"])
    ap.add_argument("--keep", action="store_true", help="keep the outputs under --work")
    ap.add_argument("--json", type=Path, default=RESULT, help="where the JSON result goes")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each measurement instead of warming it once "
        "(root: drop_caches; otherwise fadvise on the source shards)",
    )
    ap.add_argument("--naive-baseline", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_baseline:
        naive_baseline(Path(args.naive_baseline[0]), Path(args.naive_baseline[1]))
        return
    if args.source is None:
        args.source = args.work / f"synthetic-e{args.experts}-v{args.vocab}-s{args.seed}"
    t0 = time.perf_counter()
    doc = run(args)
    doc["total_s"] = round(time.perf_counter() - t0, 1)
    text = table(doc)
    doc["table_markdown"] = text
    path = write_result(args.json, doc)
    print()
    print(text)
    print(f"\nwrote {path}")
    if doc["correctness"] is not None and not doc["correctness"]["pass"]:
        for p in doc["correctness"]["problems"]:
            print(f"  {p}")
        sys.exit(1)


if __name__ == "__main__":
    main()
