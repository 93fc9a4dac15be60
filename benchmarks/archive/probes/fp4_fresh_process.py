"""fp4 and awq-w4a16 conversions each in a fresh process (issue 30, fp4's native lane;
benchmarks/notes/convert-scaling.md "fp4's quantizer"): wall seconds, CPU seconds of the process
and its pool workers, and whether ``torch`` was imported. The code before is put first on
``PYTHONPATH`` (a ``hetquant`` directory holding the older tree); runs interleaved.

    python benchmarks/archive/probes/fp4_fresh_process.py SOURCE OUT_DIR OLD_TREE_PARENT OUT.json
"""

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN = """
import sys
from hetquant.convert.cli import main
try:
    main(sys.argv[1:], prog_name="hetquant")
except SystemExit as e:
    if e.code:
        raise
print("torch:", "torch" in sys.modules)
"""
source, out, old, result = sys.argv[1:5]
cases = [("before", "fp4", old), ("after", "fp4", ""), ("after", "awq-w4a16", "")]
rows: dict[str, list[dict[str, float | bool]]] = {}
for _ in range(3):
    for workers in ("1", "2"):
        for code, recipe, path in cases:
            shutil.rmtree(out, ignore_errors=True)
            args = ["convert", source, out, "--recipe", recipe, "--workers", workers]
            env = {**os.environ, "PYTHONPATH": path}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-c", RUN, *args], env=env, capture_output=True, text=True)  # fmt: skip
            wall = time.time() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            assert proc.returncode == 0, proc.stderr[-2000:]
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            row = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "torch": "torch: True" in proc.stdout}  # fmt: skip
            rows.setdefault(f"{code} {recipe} w{workers}", []).append(row)
            print(f"{code:6} {recipe:10} w{workers}", row, flush=True)
shutil.rmtree(out, ignore_errors=True)
summary = {
    k: {"median_wall_s": statistics.median(r["wall_s"] for r in v),
        "median_cpu_s": statistics.median(r["cpu_s"] for r in v), "torch": v[0]["torch"]}
    for k, v in rows.items()
}  # fmt: skip
Path(result).write_text(json.dumps({"runs": rows, "medians": summary}, indent=1) + "\n")
print(json.dumps(summary, indent=1))
