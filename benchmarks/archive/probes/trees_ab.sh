#!/bin/bash
# Issue 30, eleventh round: conversions by several trees interleaved on the 2-vCPU VM, every tree
# from a copy on PYTHONPATH (an editable install against a copy is biased: tenth round), so that
# an A/A pair (two copies of one tree) shows the spread. Prints "recipe arm wall user sys" lines.
#
#   bash benchmarks/archive/probes/trees_ab.sh SRC "RECIPES" ROUNDS WORKERS ARM=DIR [ARM=DIR ...]
#
# DIR holds hetquant/{formats,convert,calib,runtime} (e.g. `git archive REV formats convert calib
# runtime | tar -x -C DIR/hetquant`). The first round writes bytecode: drop it when summarising.
# Used for archive/results/blake3_window_ab-2core-round11.txt (old, old2, new).
set -u
SRC=$1 RECIPES=$2 ROUNDS=$3 W=$4; shift 4
PY=${PYTHON:-python3}
for rep in $(seq "$ROUNDS"); do
  for r in $RECIPES; do
    for arm in "$@"; do
      name=${arm%%=*} dir=${arm#*=}
      rm -rf /dev/shm/trees-ab-out
      t=$( { /usr/bin/time -f "%e %U %S" env PYTHONPATH="$dir" "$PY" -c \
        'import sys; from hetquant.convert.cli import main; main(sys.argv[1:])' \
        convert "$SRC" /dev/shm/trees-ab-out --recipe "$r" --workers "$W" --overwrite > /dev/null; } 2>&1 | tail -1)
      echo "$r $name $t"
    done
  done
done
rm -rf /dev/shm/trees-ab-out
