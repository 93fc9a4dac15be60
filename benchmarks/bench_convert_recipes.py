"""Benchmark of every round-to-nearest recipe against ``bf16``: time, throughput, peak memory.

On the synthetic DeepSeek-V3 checkpoint at real shapes (``make_synthetic.py``, 16 experts, about
1.5 GB; generated into ``--source`` when absent), in ONE run, each configuration ``--repeats``
times, interleaved round-robin (every configuration once per round, in the same order), medians
reported. A configuration is ``hetquant convert SRC OUT --recipe R [options] --workers W`` as a
subprocess, for

* ``--workers 1``: ``bf16`` (the baseline: streaming FP8 → BF16 dequantization), ``ascend-hybrid``,
  ``ascend-w8a8``, ``awq-w4a16``, ``fp4`` (Ascend tiled layout, the default) and
  ``fp4 --fp4-layout nvfp4`` (canonical ModelOpt layout);
* ``--workers 2``: ``bf16`` and one quantized recipe (``--scaling``, default ``awq-w4a16``: every
  linear quantized), to show how a conversion scales over worker processes.

Measured per run, as in ``bench_convert_bf16.py`` (its helpers are reused): wall time (process
start to exit, everything the command does: validation, conversion, ``pwrite``, fsync, sha256 of
every output file for the manifest), CPU time of the process tree, and peak anonymous memory —
the maximum over time of the SUM of ``RssAnon`` over the process and all its descendants (worker
processes included), sampled every 20 ms (``_measure.TreeMonitor``). Source throughput is source
bytes / wall time, and per worker divided by ``--workers``. The page cache is warm for every run:
the source shard is read (untimed) before each run and ``sync`` runs so that no write-back of a
previous output overlaps it.

Ratios: recipe wall time / ``bf16`` wall time at the same worker count (target ≤ 1.5 for every
RTN recipe), the same for CPU time (steadier when other work shares the machine), peak anon /
source size (target ≤ 0.5), and ``--workers 2`` speed-up over ``--workers 1``. Raw numbers go to
``benchmarks/results/bench_convert_recipes.json``.

Usage::

    python benchmarks/bench_convert_recipes.py [--source DIR] [--work DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import (  # noqa: E402
    cached_fraction,
    machine_info,
    median,
    run_measured,
    warm_page_cache,
    write_result,
)
from bench_convert_bf16 import HETQUANT, INDEX, _ensure_source, _fmt_bytes  # noqa: E402

DEFAULT_WORK = Path(tempfile.gettempdir()) / "hetquant-bench-recipes"
RESULT = HERE / "results" / "bench_convert_recipes.json"
TARGETS = {"time_over_bf16": 1.5, "peak_anon_over_source": 0.5}
BASELINE = "bf16"


@dataclass(frozen=True)
class Config:
    """One measured configuration: a recipe (with CLI options) at a worker count."""

    label: str  # recipe label, e.g. "fp4 --fp4-layout nvfp4"
    recipe: str
    options: tuple[str, ...]
    workers: int

    @property
    def key(self) -> str:
        return f"{self.label} | w{self.workers}"

    @property
    def slug(self) -> str:
        return f"{self.label.replace(' --', '-').replace(' ', '-')}-w{self.workers}"


RECIPES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("bf16", "bf16", ()),
    ("ascend-hybrid", "ascend-hybrid", ()),
    ("ascend-w8a8", "ascend-w8a8", ()),
    ("awq-w4a16", "awq-w4a16", ()),
    ("fp4", "fp4", ()),
    ("fp4 --fp4-layout nvfp4", "fp4", ("--fp4-layout", "nvfp4")),
)


def configs(scaling: str) -> list[Config]:
    out = [Config(label, r, opts, 1) for label, r, opts in RECIPES]
    for label in (BASELINE, scaling):
        label_, r, opts = next(x for x in RECIPES if x[0] == label)
        out.append(Config(label_, r, opts, 2))
    return out


def command(cfg: Config, src: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-c", HETQUANT, "convert", str(src), str(out),
        "--recipe", cfg.recipe, *cfg.options, "--workers", str(cfg.workers),
    ]  # fmt: skip


def code_fingerprint() -> str:
    """sha256 over the converter's sources (convert/, formats/): the repository is shared, and a
    change landing mid-run would mix two versions in one table; checked at start and end."""
    h = hashlib.sha256()
    root = HERE.parent
    for p in sorted([*root.glob("convert/**/*.py"), *root.glob("formats/**/*.py")]):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _measure_rounds(
    args: argparse.Namespace, cfgs: list[Config], src: Path, shards: list[Path], env: dict
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Every configuration once per round (round-robin), ``--repeats`` rounds, the page cache
    warm before each; the runs and each configuration's output size."""
    work: Path = args.work.resolve()
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in cfgs}
    out_bytes: dict[str, int] = {}
    for rep in range(args.repeats):
        for cfg in cfgs:
            out = work / cfg.slug
            shutil.rmtree(out, ignore_errors=True)
            warm_page_cache(shards)
            os.sync()
            resident = cached_fraction(shards)
            r = run_measured(command(cfg, src, out), env=env)
            if not (out / "hetquant.json").is_file():
                raise RuntimeError(f"{cfg.key}: no hetquant.json in {out}")
            out_bytes[cfg.key] = _tree_bytes(out)
            shutil.rmtree(out, ignore_errors=True)
            r["source_cached_fraction_before"] = resident
            out_, err = r.pop("stdout"), r.pop("stderr")
            r["stdout_tail"], r["stderr_tail"] = out_[-300:], err[-300:]
            r["cpu_s"] = r["cpu_user_s"] + r["cpu_sys_s"]
            runs[cfg.key].append(r)
            print(
                f"  [{rep + 1}/{args.repeats}] {cfg.key:32s} {r['wall_s']:7.2f} s wall "
                f"{r['cpu_s']:7.2f} s cpu   peak anon {_fmt_bytes(r['peak_anon_bytes']):>8s}   "
                f"({r['samples']} samples, {r['peak_processes']} process(es), "
                f"load {r['loadavg_1min_before']:.1f}, source cached {resident or 0:.0%})",
                flush=True,
            )
    return runs, out_bytes


def _summary(
    cfgs: list[Config],
    runs: dict[str, list[dict[str, Any]]],
    out_bytes: dict[str, int],
    source_bytes: int,
) -> dict[str, dict[str, Any]]:
    """Medians per configuration, with source GB/s (and per worker) and the output size."""
    summary = {}
    for cfg in cfgs:
        rs = runs[cfg.key]
        wall = median([r["wall_s"] for r in rs])
        summary[cfg.key] = {
            "recipe": cfg.label,
            "workers": cfg.workers,
            "wall_s": wall,
            "cpu_s": median([r["cpu_s"] for r in rs]),
            "peak_anon_bytes": median([r["peak_anon_bytes"] for r in rs]),
            "peak_file_bytes": median([r["peak_file_bytes"] for r in rs]),
            "source_gb_per_s": source_bytes / 1e9 / wall,
            "source_gb_per_s_per_worker": source_bytes / 1e9 / wall / cfg.workers,
            "output_bytes": out_bytes[cfg.key],
            "loadavg_1min_before": [r["loadavg_1min_before"] for r in rs],
        }
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    src: Path = args.source.resolve()
    _ensure_source(src, args.experts, args.vocab, args.seed)
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    shards = [src / f for f in sorted(set(weight_map.values()))]
    source_bytes = sum(p.stat().st_size for p in shards)
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < 3 * source_bytes:
        sys.exit(
            f"error: {work} has {_fmt_bytes(free)} free; needs ~{_fmt_bytes(3 * source_bytes)}"
        )
    env = dict(os.environ)
    if args.threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(args.threads)
    cfgs = configs(args.scaling)
    machine, code_start = machine_info(), code_fingerprint()
    runs, out_bytes = _measure_rounds(args, cfgs, src, shards, env)
    summary = _summary(cfgs, runs, out_bytes, source_bytes)
    _add_ratios(summary, source_bytes)
    code_end = code_fingerprint()
    if code_end != code_start:
        print(f"WARNING: convert/ or formats/ changed during the run ({code_start} → {code_end})")
    return {
        "benchmark": "bench_convert_recipes",
        "machine": machine,
        "code_fingerprint": {
            "start": code_start,
            "end": code_end,
            "changed": code_end != code_start,
        },
        "command": " ".join(["python", "benchmarks/bench_convert_recipes.py", *sys.argv[1:]]),
        "source": {
            "path": str(src),
            "experts": args.experts,
            "vocab": args.vocab,
            "seed": args.seed,
            "shard_bytes": source_bytes,
            "tensors": len(weight_map),
        },
        "page_cache": "warm: source shard read (untimed) and sync run before each measurement",
        "repeats": args.repeats,
        "threads": args.threads or f"torch default ({os.cpu_count()}; workers use 1 each)",
        "order": "round-robin: " + ", ".join(c.key for c in cfgs) + " per round",
        "commands": {c.key: command(c, src, work / c.slug) for c in cfgs},
        "runs": runs,
        "median": summary,
        "targets": TARGETS,
        "targets_met": targets_met(summary),
    }


def _add_ratios(summary: dict[str, dict[str, Any]], source_bytes: int) -> None:
    for s in summary.values():
        base = summary.get(f"{BASELINE} | w{s['workers']}")
        one = summary.get(f"{s['recipe']} | w1")
        s["time_over_bf16"] = s["wall_s"] / base["wall_s"] if base else None
        s["cpu_over_bf16_cpu"] = s["cpu_s"] / base["cpu_s"] if base else None
        s["peak_anon_over_source"] = s["peak_anon_bytes"] / source_bytes
        s["speedup_over_w1"] = one["wall_s"] / s["wall_s"] if one and s["workers"] > 1 else None


def targets_met(summary: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Time: every quantized recipe at ``--workers 1``; memory: every configuration."""
    timed = [s for s in summary.values() if s["recipe"] != BASELINE and s["workers"] == 1]
    t, a = TARGETS["time_over_bf16"], TARGETS["peak_anon_over_source"]
    return {
        "time_over_bf16": all(s["time_over_bf16"] <= t for s in timed),
        "peak_anon_over_source": all(s["peak_anon_over_source"] <= a for s in summary.values()),
    }


def table(doc: dict[str, Any]) -> str:
    """The markdown table of medians and ratios (what notes/convert-recipes.md records)."""
    t, a = TARGETS["time_over_bf16"], TARGETS["peak_anon_over_source"]
    lines = [
        "| recipe | workers | wall (median) | CPU (median) | source GB/s | per worker | "
        f"time / bf16 (≤ {t}) | CPU / bf16 CPU | peak RssAnon (tree) | anon / source (≤ {a}) "
        "| speed-up vs 1 worker | output |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def mark(v: float | None, target: float, applies: bool = True, digits: int = 2) -> str:
        if v is None:
            return ""
        return f"{v:.{digits}f}" + ("" if not applies or v <= target else " **(missed)**")

    for s in doc["median"].values():
        is_base = s["recipe"] == BASELINE
        speedup = "" if s["speedup_over_w1"] is None else f"{s['speedup_over_w1']:.2f}×"
        lines.append(
            f"| `{s['recipe']}` | {s['workers']} | {s['wall_s']:.1f} s | {s['cpu_s']:.1f} s | "
            f"{s['source_gb_per_s']:.3f} | {s['source_gb_per_s_per_worker']:.3f} | "
            f"{mark(s['time_over_bf16'], t, not is_base and s['workers'] == 1)} | "
            f"{s['cpu_over_bf16_cpu']:.2f} | "
            f"{_fmt_bytes(s['peak_anon_bytes'])} | {mark(s['peak_anon_over_source'], a, digits=3)} | "
            f"{speedup} | {_fmt_bytes(s['output_bytes'])} |"
        )
    met = doc["targets_met"]
    lines.append("")
    lines.append(
        f"Targets: every RTN recipe time / bf16 ≤ {t} (at --workers 1): "
        f"**{'met' if met['time_over_bf16'] else 'not met'}**; peak anon / source ≤ {a}: "
        f"**{'met' if met['peak_anon_over_source'] else 'not met'}**."
    )
    code = doc.get("code_fingerprint") or {}
    if code.get("changed"):
        lines.append(
            f"**Warning**: convert/ or formats/ changed during the run ({code['start']} → "
            f"{code['end']}); the rounds measured different code."
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
        "--scaling",
        default="awq-w4a16",
        choices=[r[0] for r in RECIPES if r[0] != BASELINE],
        help="the quantized recipe also run with --workers 2",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS for the converts (default: unset; the engine runs block-row jobs "
        "on one torch thread itself)",
    )
    ap.add_argument("--json", type=Path, default=RESULT, help="where the JSON result goes")
    args = ap.parse_args()
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
    print(f"\nwrote {path} ({doc['total_s']} s in all)")


if __name__ == "__main__":
    main()
