#!/bin/bash
# Issue 30, tenth round: the same 16-worker conversion onto /dev/shm (huge=never, the default)
# and onto a tmpfs mounted huge=always, interleaved, two rounds; wall, user, system seconds per
# conversion, and the shmem huge pages the output took. Needs root (mount) and ~75 GB of memory.
#
#   bash benchmarks/archive/probes/tmpfs_huge_ab.sh [SRC]
#
# SRC: a two-MoE-layer synthetic source (made on /dev/shm when absent). Run from the repository
# root with hetquant importable (PYTHONPATH). Output: stdout.
set -u
SRC=${1:-/dev/shm/src}
[ -e "$SRC" ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import make_synthetic as m
from pathlib import Path; m.write_checkpoint(Path('$SRC'), 256, jobs=16, moe_layers=2, quiet=True)"
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/kernel/mm/transparent_hugepage/defrag
mkdir -p /mnt/hqhuge && mount -t tmpfs -o size=60G,huge=always hqhuge /mnt/hqhuge || exit 1
conv() { python3 -c 'import sys; from hetquant.convert.cli import main; main(sys.argv[1:])' \
  convert "$SRC" "$2" --recipe "$1" --overwrite --workers "${W:-16}" > /dev/null; }
conv bf16 /dev/shm/out; rm -rf /dev/shm/out  # warm
TIMEFORMAT="%R %U %S"
for rep in 1 2; do
  for r in ${RECIPES:-bf16 ascend-hybrid awq-w4a16}; do
    for d in /dev/shm/out /mnt/hqhuge/out; do
      t=$( { time (conv "$r" "$d" 2>/tmp/err); } 2>&1 )
      echo "$r $d $t $(grep ShmemHugePages /proc/meminfo | tr -s ' ') $(tail -c 200 /tmp/err)"
      rm -rf "$d"
    done
  done
done
umount /mnt/hqhuge
