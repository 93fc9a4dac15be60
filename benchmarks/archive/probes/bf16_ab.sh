#!/usr/bin/env bash
# A/B of the bf16 recipe: an older hetquant commit against the working tree, run back to back,
# twice, on the same source (benchmarks/README.md "Recipes convert", baseline drift).
# Usage: bash benchmarks/archive/probes/bf16_ab.sh SOURCE_DIR [OLD_COMMIT]   (default cc05db9)
set -euo pipefail
src=$1; old=${2:-cc05db9}
source "$(dirname "$0")/_ab_trees.sh"
ab_trees "$old"
for i in 1 2; do
  for pp in "$tmp/oldpkg" "$tmp/newpkg"; do
    rm -rf "$tmp/out"
    /usr/bin/time -f "$(basename "$pp") %e s wall %U+%S s cpu" env PYTHONPATH="$pp" python -c \
      'import sys; from hetquant.convert.cli import main; sys.argv[0] = "hetquant"; main()' \
      convert "$src" "$tmp/out" --recipe bf16 --workers 1 > /dev/null 2> "$tmp/err"
    tail -1 "$tmp/err"
  done
done
rm -rf "$tmp"
