#!/usr/bin/env bash
# A/B of the model-family registry (formats/families) against an older commit, run back to back,
# three times, on the real DeepSeek-V3 layout (headers only): SourceCheckpoint.open (the role
# table expanded and every tensor checked against it) and runtime.shard_rules.place for every
# module (what open_artifact does per module).
# Usage: bash benchmarks/archive/probes/families_ab.sh [OLD_COMMIT]   (default 377fcd4, before the registry)
set -euo pipefail
old=${1:-377fcd4}
source "$(dirname "$0")/_ab_trees.sh"
ab_trees "$old"
python "$repo/examples/deepseek-v3-layout/make_layout.py" "$tmp/r1"
probe='
import sys, time
from hetquant.convert.source import SourceCheckpoint
try:
    from hetquant.runtime.parallel.shard_rules import place
except ImportError:  # a tree from before runtime/ was regrouped (377fcd4)
    from hetquant.runtime.shard_rules import place
t0 = time.perf_counter(); src = SourceCheckpoint.open(sys.argv[1]); t1 = time.perf_counter()
mods = sorted({n.rpartition(".")[0] for n in src.tensors})
t2 = time.perf_counter(); [place(m) for m in mods]; t3 = time.perf_counter()
print(f"open {t1 - t0:.3f} s, place x{len(mods)} {t3 - t2:.3f} s")'
for i in 1 2 3; do
  for pp in "$tmp/oldpkg" "$tmp/newpkg"; do
    echo -n "$(basename "$pp") "; PYTHONPATH="$pp" python -c "$probe" "$tmp/r1"
  done
done
rm -rf "$tmp"
