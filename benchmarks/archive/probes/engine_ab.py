"""A/B of the convert engine: an older commit against the working tree, in one run.

What the engine's safeguards cost (fallocate of every output file, a lock, the source identity
checks before and after every job, the work-directory build and the move into OUTPUT): the same
``hetquant convert`` of the synthetic DeepSeek-V3 checkpoint (``make_synthetic.py``, as
``bench_convert_recipes.py`` makes it) run by the baseline commit's code and by the working
tree's, interleaved (old, new, old, new, …), ``--repeats`` times per configuration; medians of
wall and CPU time and their ratios new / old. Both trees run in this venv (``PYTHONPATH`` to a
package dir per tree, as ``bf16_ab.sh`` does). Raw numbers: ``benchmarks/results/engine_ab.json``.

Usage::

    python benchmarks/archive/probes/engine_ab.py [--baseline 377fcd4] [--repeats 3] [--source DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1]
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from _measure import machine_info, median, run_measured, warm_page_cache, write_result  # noqa: E402
from bench_convert_bf16 import HETQUANT, _ensure_source  # noqa: E402

CONFIGS = [("bf16", 1), ("bf16", 2), ("ascend-hybrid", 1), ("ascend-hybrid", 2)]
PACKAGES = ("formats", "convert", "calib", "runtime")


def _package_dirs(tmp: Path, baseline: str) -> dict[str, Path]:
    """``hetquant`` importable from the baseline commit ('old') and the working tree ('new')."""
    old_tree = tmp / "old-tree"
    old_tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", baseline], check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
    dirs = {}
    for label, tree in (("old", old_tree), ("new", REPO)):
        pkg = tmp / f"{label}-pkg" / "hetquant"
        pkg.mkdir(parents=True)
        for d in PACKAGES:
            (pkg / d).symlink_to(tree / d)
        dirs[label] = pkg.parent
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="377fcd4", help="commit the working tree is compared to")
    ap.add_argument("--source", type=Path, default=Path(tempfile.gettempdir()) / "hetquant-bench" / "synthetic")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=HERE.parent / "results" / "engine_ab.json")
    args = ap.parse_args()
    _ensure_source(args.source, 16, 1024, 0)
    shards = sorted(args.source.glob("*.safetensors"))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(dir=args.source.parent) as tmp_name:
        tmp = Path(tmp_name)
        pkgs = _package_dirs(tmp, args.baseline)
        for rnd in range(args.repeats):
            for recipe, workers in CONFIGS:
                for label in ("old", "new"):
                    out = tmp / "out"
                    shutil.rmtree(out, ignore_errors=True)
                    warm_page_cache(shards)
                    os.sync()
                    env = dict(os.environ, PYTHONPATH=str(pkgs[label]))
                    cmd = [sys.executable, "-c", HETQUANT, "convert", str(args.source), str(out), "--recipe", recipe, "--workers", str(workers)]  # fmt: skip
                    r = run_measured(cmd, env=env, cwd=tmp)
                    key = f"{recipe} --workers {workers} {label}"
                    row = {"wall_s": r["wall_s"], "cpu_s": r["cpu_user_s"] + r["cpu_sys_s"]}
                    row |= {k: r[k] for k in ("peak_anon_bytes", "loadavg_1min_before")}
                    runs.setdefault(key, []).append(row)
                    print(f"round {rnd + 1}: {key}: {row['wall_s']:.2f} s wall, {row['cpu_s']:.2f} s cpu", flush=True)  # fmt: skip
    summary = {}
    for recipe, workers in CONFIGS:
        cfg = f"{recipe} --workers {workers}"
        old, new = runs[f"{cfg} old"], runs[f"{cfg} new"]
        row = {
            m: {"old": median([r[m] for r in old]), "new": median([r[m] for r in new])}
            for m in ("wall_s", "cpu_s", "peak_anon_bytes")
        }
        for m in row.values():
            m["new_over_old"] = round(m["new"] / m["old"], 3)
        summary[cfg] = row
        print(f"{cfg:<32} wall new/old {row['wall_s']['new_over_old']:.3f}  cpu new/old {row['cpu_s']['new_over_old']:.3f}  peak anon new/old {row['peak_anon_bytes']['new_over_old']:.3f}")  # fmt: skip
    doc = {"baseline": args.baseline, "repeats": args.repeats, "machine": machine_info()}
    write_result(args.json, doc | {"summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
