"""What every recipe makes of DeepSeek-V3/R1 (671B), predicted by ``--dry-run`` on the real layout.

Writes the real checkpoint layout (163 shards, every tensor name/dtype/shape, data as sparse holes)
into a temporary directory, then runs ``hetquant convert SRC OUT --recipe R --dry-run`` for every
recipe as a subprocess, timing it, and sums the planned files per artifact part.

    python benchmarks/dry_run_671b.py
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "dry_run_671b.json"
RECIPES = [("bf16", []), ("ascend-hybrid", []), ("ascend-hybrid", ["--cpu-group-size", "64"]),
           ("ascend-hybrid", ["--cpu-group-size", "32"]), ("ascend-w8a8", []), ("awq-w4a16", []),
           ("awq-w4a16", ["--group-size", "64"]), ("fp4", []), ("fp4", ["--fp4-layout", "nvfp4"])]  # fmt: skip
LINE = re.compile(r"^\s+(\S+)\s+([\d,]+) bytes")
TOTAL = re.compile(r"^total\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)$")


def load_make_layout():  # type: ignore[no-untyped-def]
    """``examples/deepseek-v3-layout/make_layout.py`` as a module."""
    spec = importlib.util.spec_from_file_location(
        "ml", REPO / "examples/deepseek-v3-layout/make_layout.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dry_run(src: Path, out: Path, recipe: str, extra: list[str]) -> dict:
    """``hetquant convert SRC OUT --recipe R EXTRA --dry-run``: seconds, bytes per part, bits/w
    (a refusal, exit 2, is recorded with its error line)."""
    t = time.perf_counter()
    cmd = ["hetquant", "convert", str(src), str(out), "--recipe", recipe, *extra, "--dry-run"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    row: dict = {"recipe": " ".join([recipe, *extra]), "seconds": round(time.perf_counter() - t, 1)}
    if res.returncode == 2:
        return {**row, "refused": res.stderr.strip()}
    res.check_returncode()
    parts: dict[str, int] = {}
    for line in res.stdout.splitlines():
        if m := LINE.match(line):
            part = "cpu_experts" if m.group(1).startswith("cpu_experts/") else "root"
            parts[part] = parts.get(part, 0) + int(m.group(2).replace(",", ""))
    bits = next(float(m.group(3)) for ln in res.stdout.splitlines() if (m := TOTAL.match(ln)))
    return {**row, "parts": parts, "bits_per_weight": bits}


def print_rows(rows: list[dict]) -> None:
    print(f"{'recipe':<32} {'root GB':>9} {'cpu_experts GB':>15} {'bits/w':>7} {'dry-run s':>10}")
    for r in rows:
        if "refused" in r:
            print(f"{r['recipe']:<32} refused: {r['refused'][:90]}")
            continue
        root, cpu = r["parts"].get("root", 0) / 1e9, r["parts"].get("cpu_experts", 0) / 1e9
        print(
            f"{r['recipe']:<32} {root:>9.1f} {cpu:>15.1f} {r['bits_per_weight']:>7.3f} {r['seconds']:>10.1f}"
        )


def write_results(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON at ``path``, with the date and the Python version."""
    path.parent.mkdir(exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0]}
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


def main() -> None:
    mod = load_make_layout()
    with tempfile.TemporaryDirectory() as tmp:
        src = mod.write_layout(Path(tmp) / "DeepSeek-R1")
        rows = [dry_run(src, Path(tmp) / "out", recipe, extra) for recipe, extra in RECIPES]
    print_rows(rows)
    write_results(RESULTS, rows)


if __name__ == "__main__":
    main()
