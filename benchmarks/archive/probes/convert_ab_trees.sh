#!/usr/bin/env bash
# Convert A/B of two hetquant trees on one source, interleaved: for each round, each recipe, the
# NEW tree then the OLD one (`hetquant convert SRC OUT --recipe R --workers 1 --overwrite` with
# PYTHONPATH pointing at either tree), page cache warm, wall seconds appended to $OUT/ab.txt.
# Usage: convert_ab_trees.sh NEW_TREE OLD_TREE [SOURCE]  (a tree holds formats/ convert/ calib/
# runtime/, e.g. `git archive 0dfd847 formats convert calib runtime | tar -x -C old`).
# This is the loop behind benchmarks/README.md "Architecture change (issue #11)".
set -eu
new=$(realpath "$1"); old=$(realpath "$2"); src=${3:-/tmp/hqsyn}; out=${OUT:-.}
mk() { mkdir -p "$1/hetquant"; for d in formats convert calib runtime; do ln -sfn "$2/$d" "$1/hetquant/$d"; done; }
mk /tmp/hqnew "$new"; mk /tmp/hqold "$old"
here=$(dirname "$0")
[ -d "$src" ] || PYTHONPATH=/tmp/hqnew python3 "$here/../../make_synthetic.py" "$src" > /dev/null
HQ="import sys; from hetquant.convert.cli import main; sys.argv[0]='hetquant'; main()"
for round in 1 2 3; do for r in bf16 awq-w4a16 ascend-hybrid; do for t in new old; do
  cat "$src"/*.safetensors > /dev/null; sync
  s=$EPOCHREALTIME
  PYTHONPATH=/tmp/hq$t python3 -c "$HQ" convert "$src" /tmp/ab-$t --recipe $r --workers 1 --overwrite >/dev/null 2>&1 || echo FAIL
  e=$EPOCHREALTIME
  python3 -c "print('AB', $round, '$r', '$t', round($e - $s, 2))" | tee -a "$out/ab.txt"
done; done; done
