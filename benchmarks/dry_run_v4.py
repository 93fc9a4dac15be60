"""What the recipes make of DeepSeek-V4-Flash and -Pro, predicted by ``--dry-run`` on their layouts
(every tensor name, dtype and shape as DeepSeek ships them, data as sparse holes:
``examples/deepseek-v4-layout/make_layout.py``, whose docstring says which config values are
verified). Per recipe: bytes of the root (NPU) part and of ``cpu_experts/``, bits per weight, or
the refusal line (FP4 experts re-quantized without ``--requantize``); per model the tensor-parallel
sizes its heads and output groups allow (``tp_head_counts``: a size must divide both).

    python benchmarks/dry_run_v4.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from dry_run_671b import REPO, dry_run, print_rows

from hetquant.formats.families import ModelConfig

RESULTS = REPO / "benchmarks" / "results" / "dry_run_v4.json"
RECIPES = [("bf16", []), ("ascend-hybrid", []), ("ascend-w8a8", []), ("ascend-w4a8", []),
           ("ascend-w4a8", ["--requantize"]), ("awq-w4a16", ["--requantize"]),
           ("ct-w4a16", ["--requantize"]), ("fp4", ["--requantize"])]  # fmt: skip


def _layout():  # type: ignore[no-untyped-def]
    path = REPO / "examples/deepseek-v4-layout/make_layout.py"
    spec = importlib.util.spec_from_file_location("v4layout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    mod = _layout()
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "models": {}}
    for name in ("V4-Flash", "V4-Pro"):
        with tempfile.TemporaryDirectory() as tmp:
            src = mod.write_layout(Path(tmp) / name, name)
            cfg = ModelConfig.load(src / "config.json")
            g = math.gcd(*cfg.tp_head_counts)
            tp = [d for d in range(1, g + 1) if g % d == 0]
            rows = [dry_run(src, Path(tmp) / "out", r, extra) for r, extra in RECIPES]
        print(f"\n{name} (head / o_group TP sizes: {tp})")
        print_rows(rows)
        doc["models"][name] = {"tp_sizes_heads_allow": tp, "rows": rows}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
