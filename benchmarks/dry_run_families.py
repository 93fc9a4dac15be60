"""What the recipes make of Kimi K2 (Instruct, FP8; Thinking, INT4 experts) and DeepSeek-V3.2,
predicted by ``--dry-run`` on their real layouts (every tensor name, dtype and shape, data as sparse
holes: ``examples/deepseek-v3-layout/make_layout.py`` with the families' configs beside it).

For each model it writes the layout into a temporary directory, runs ``hetquant convert SRC OUT
--recipe R --dry-run`` per recipe as a subprocess, and sums the planned files per artifact part
(root = NPU part, cpu_experts/); a recipe the source refuses (a 4-bit source re-quantized without
``--requantize``) is recorded with its error line.

    python benchmarks/dry_run_families.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from dry_run_671b import REPO, dry_run, load_make_layout, print_rows

RESULTS = REPO / "benchmarks" / "results" / "dry_run_families.json"
LAYOUT = REPO / "examples" / "deepseek-v3-layout"
ALL = [("bf16", []), ("ascend-hybrid", []), ("ascend-w8a8", []), ("awq-w4a16", []), ("fp4", [])]
MODELS = {  # name: (config, shards, recipes)
    "Kimi-K2-Instruct": ("config_kimi_k2.json", 62, ALL),
    "Kimi-K2-Thinking": ("config_kimi_k2_thinking.json", 62,
                         [*ALL[:4], ("awq-w4a16", ["--requantize"])]),
    "DeepSeek-V3.2": ("config_deepseek_v32.json", 163, ALL),
}  # fmt: skip


def main() -> None:
    mod = load_make_layout()
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "models": {}}
    for name, (config, shards, recipes) in MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            src = mod.write_layout(Path(tmp) / name, LAYOUT / config, shards)
            rows = [dry_run(src, Path(tmp) / "out", r, extra) for r, extra in recipes]
        print(f"\n{name}")
        print_rows(rows)
        doc["models"][name] = rows
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
