#!/bin/bash
# Issue 30, ninth round: where a 16-worker conversion onto tmpfs spends its CPU (perf, system-wide),
# and two trees interleaved on the same source (wall, user, system seconds per conversion).
#
#   PERF="perf" bash benchmarks/archive/probes/convert_perf_ab.sh OLD_TREE NEW_TREE [SRC]
#
# OLD_TREE / NEW_TREE: directories holding formats/ convert/ calib/ runtime/ (e.g. `git archive
# REV formats convert calib runtime | tar -x -C DIR`); SRC defaults to a two-MoE-layer synthetic
# source made here (23.6 GB on /dev/shm). PERF: how to run perf (the lent hosts have none: carry
# the VM's binary and its libraries, run through their ld.so). Env HQ_VARIANT adds
# a third arm: NEW_TREE with that environment (HQ_VARIANT='VAR=VALUE ...': a toggle under test).
# RECIPES: which to time (all five); REPS: interleaved rounds (2). Output: $OUT or /tmp.
set -u
OLD=$1 NEW=$2 SRC=${3:-/dev/shm/src/synthetic-e256-m2} OUT=${OUT:-/tmp}
for t in hqo:$OLD hqn:$NEW; do
  n=${t%%:*}; d=${t#*:}; mkdir -p /tmp/$n/hetquant
  for m in formats convert calib runtime; do ln -sfn "$(realpath "$d/$m")" /tmp/$n/hetquant/$m; done
done
export PYTHONPATH=/tmp/hqn:${EXTRA_PATH:-}
B="$(python3 -c 'import sys; sys.path.insert(0,"benchmarks"); from bench_convert_scaling import BUILD_KERNELS as B; print(B)')"
PYTHONPATH=/tmp/hqo:${EXTRA_PATH:-} python3 -c "$B"; python3 -c "$B"
[ -e "$SRC" ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import make_synthetic as m
from pathlib import Path; m.write_checkpoint(Path('$SRC'), 256, jobs=16, moe_layers=2, quiet=True)"
conv() { python3 -c 'import sys; from hetquant.convert.cli import main; main(sys.argv[1:])' \
  convert "$SRC" /dev/shm/out --recipe "$1" --overwrite --workers "${W:-16}" > /dev/null; }
conv bf16; rm -rf /dev/shm/out  # warm
if [ -n "${PERF:-}" ]; then
  for r in bf16 ascend-hybrid awq-w4a16; do
    $PERF record -q -a -g -F 499 -o /tmp/p.data -- bash -c "$(declare -f conv); SRC=$SRC; conv $r" 2>/dev/null
    $PERF report -i /tmp/p.data --no-children --sort sym --percent-limit 0.7 -g none 2>/dev/null \
      | grep -v "^#" | grep . > "$OUT/perf-$r.txt"
    $PERF report -i /tmp/p.data --no-children --sort sym --percent-limit 3 \
      -g caller,0.5,callee,function,percent --max-stack 12 2>/dev/null | grep -v "^#" > "$OUT/perf-$r-graph.txt"
    rm -rf /dev/shm/out
  done
fi
TIMEFORMAT="%R %U %S"
declare -A ARM=([old]="PYTHONPATH=/tmp/hqo:${EXTRA_PATH:-}" [new]="" [var]="${HQ_VARIANT:-}")
for rep in $(seq "${REPS:-2}"); do
  for r in ${RECIPES:-bf16 ascend-hybrid ascend-w8a8 awq-w4a16 fp4}; do
    for a in old new ${HQ_VARIANT:+var}; do
      t=$( { time (env ${ARM[$a]} bash -c "$(declare -f conv); SRC=$SRC; conv $r" 2>/tmp/err); } 2>&1 )
      echo "$r $a $t $(tail -c 200 /tmp/err)"
      rm -rf /dev/shm/out
    done
  done
done
