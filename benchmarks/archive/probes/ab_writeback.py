"""A/B of the early write-back (issue 30; benchmarks/notes/convert-scaling.md): one MoE layer,
32 workers, output on disk, the baseline with ``fs/writeback._CALL`` patched to None. Run from the
repository root on the device host: ``python3 ab_writeback.py OUT.json``."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import bench_convert_limit as b

args = argparse.Namespace(
    moe_layers=1,
    experts=256,
    source_dir=Path("/tmp/hq-src"),
    work=Path("/tmp/hq-out"),
    threads=b.cores(),
)
src = b.make_source(args)
ON = b.HETQUANT
OFF = "import hetquant.convert.fs.writeback as w; w._CALL = None; " + ON
rows = []
for recipe in ("ascend-hybrid", "bf16"):
    for mode, code in (("none", OFF), ("queue", ON)):
        b.HETQUANT = code
        r = b.convert_once(src, args.work / f"{recipe}-{mode}", recipe, 32, args)
        r["recipe"] = f"{recipe}/{mode}"
        rows.append(r)
        print(b.table(rows[-1:]).splitlines()[-1], flush=True)
        for x in rows:
            x.pop("busy_cores_trace", None)
        json.dump(
            {"machine": b.machine_info(), "rows": rows},
            open(sys.argv[1], "w"),
            indent=1,
            default=str,
        )
