#!/usr/bin/env bash
# Issue 30, seventh round: workers hashing what they wrote (5ef38b0) against the parent's threads
# reading it back (7fadedb). CPU and wall of `hetquant convert --workers 2` into /dev/shm,
# interleaved old / new. Needs: a worktree of 7fadedb with its packages linked under
# $OLD/hetquant (formats, convert, calib, runtime), and a source, e.g.
# `python benchmarks/make_synthetic.py /tmp/syn64 --experts 64 --jobs 2` (3.66 GB).
# Usage: OLD=/tmp/hqold SRC=/tmp/syn64 RECS="bf16 fp4" ROUNDS="1 2 3" bash hash_in_worker_ab.sh
set -u
PY=${PY:-python3}
for r in ${ROUNDS:-1 2 3}; do
  for rec in ${RECS:-bf16 fp4}; do
    for side in old new; do
      rm -rf /dev/shm/hq-ab
      if [ "$side" = old ]; then pp=$OLD; else pp=; fi
      PYTHONPATH=$pp /usr/bin/time -f "$rec $side wall %e user %U sys %S" "$PY" -c \
        "import sys; from hetquant.convert.cli import main; main(sys.argv[1:])" \
        convert "$SRC" /dev/shm/hq-ab --recipe "$rec" --workers 2 2>&1 >/dev/null | tail -1
    done
  done
done
rm -rf /dev/shm/hq-ab
