"""Plan → validate → execute, resumable and safe to interrupt: the body of ``hetquant convert``.

OUTPUT is held as a transaction (``transaction.py``: lock, signals, OS errors, resume, the move
into OUTPUT). The work happens in ``OUTPUT/.hetquant-partial/`` (``fs/workdir.py``): containers are created at their final size (space
checked first, from the plan's exact sizes, and reserved but on tmpfs), jobs write their byte
ranges, in this process or in workers (``execute``), in ``hashing.fill_order``, a journal records
finished jobs, and each file is hashed and fsynced as it fills (``hashing``). Re-running the same
command (same source files, recipe and options → same plan digest) skips journaled jobs and redoes
the rest, giving byte-identical files; jobs that read a source file changed since are redone too.
When every job is done the artifact is completed in the work directory and then moved into
OUTPUT, manifest last (``finalize``), so a previous artifact stays valid until the new one is
whole. Re-running a finished command is a no-op ("already complete").

Every failure is one ``HetquantError`` line: bad input, a full disk (bytes needed and free), an
OS error (the path), a changed source, a dead worker, SIGINT/SIGTERM (the journal is kept).
With ``-v`` a ``timings`` line at the end gives the phases (``benchmarks/bench_convert_scaling.py``
reads it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME

from ..fs.diskspace import free_bytes, free_inodes, inode_error, space_error, space_needed
from ..fs.source_guard import SourceGuard, job_files
from ..planning.plan import Plan, plan_for
from ..planning.source import SourceCheckpoint
from ..recipes import Recipe
from .calibration import calibration_record
from .execute import run_jobs, sigbus_exits
from .finalize import artifact_names, build, carried_files, json_size, metadata_docs
from .hashing import fill_order, fill_width, hash_threads
from .transaction import Transaction, check_target
from .tree_hashing import container_hashes

__all__ = ["ConvertResult", "convert"]

log = logging.getLogger("hetquant.convert")
_MANIFEST_BYTES_PER_FILE = 256  # a file's entry in hetquant.json, with room to spare
_SCRATCH_FILES = 8  # manifest, journal, source ids, owned list, temporary names, a probe


@dataclass
class ConvertResult:
    plan: Plan
    manifest: dict[str, Any]
    resumed_jobs: int
    already_complete: bool = False


def convert(
    source: SourceCheckpoint,
    output: Path,
    recipe: Recipe,
    *,
    max_shard_size: int,
    workers: int = 1,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    calibration: Any = None,
    calibrate: Callable[[], Any] | None = None,
    plan: Plan | None = None,
) -> ConvertResult:
    """Convert ``source`` into the artifact directory ``output`` (see module docstring).

    ``plan``: ``plan_for(source, recipe, max_shard_size)`` when the caller already made it (the
    CLI, for ``--dry-run`` and the calibration check): the plan is built once.

    ``calibration`` (a ``calib.CalibrationResult``), or ``calibrate`` returning one once OUTPUT is
    locked: AWQ transforms applied to the weights, norms and routers it covers before they are
    quantized or copied; part of the plan's identity.
    """
    tx = Transaction(source.root, output.resolve())
    if (calibration is not None or calibrate is not None) and not recipe.calibrates:
        raise HetquantError(f"recipe {recipe.name} does not calibrate; drop --calib-data")
    entered = time.time()
    if plan is None:
        plan = plan_for(source, recipe, max_shard_size)
    elif plan.recipe != recipe or plan.max_shard_size != max_shard_size:
        raise ValueError(f"the plan given is of recipe {plan.recipe.name}, shards of {plan.max_shard_size} bytes, not {recipe.name}, {max_shard_size}")  # fmt: skip
    run = _Run(source, plan, tx)
    tx.jobs = len(plan.jobs)
    run.timings.update(entered=entered, plan_s=time.time() - entered)
    with tx.held(disk_full=run.disk_full), sigbus_exits(_SIGBUS.format(root=source.root)):
        if calibrate is not None:
            calibration = calibrate()
        return run.execute(workers, overwrite, progress, calibration)


_SIGBUS = (
    "SOURCE {root} changed during conversion: a shard was truncated while it was being read "
    "(SIGBUS); no manifest was written — once the source is complete and stable, re-run the same "
    "command to resume"
)


@dataclass
class _Run:
    """One convert into OUTPUT, held (``tx``)."""

    source: SourceCheckpoint
    plan: Plan
    tx: Transaction
    timings: dict[str, Any] = field(default_factory=dict)  # logged at debug level

    @property
    def work(self) -> Path:
        return self.tx.work.path

    def execute(
        self, workers: int, overwrite: bool, progress: Callable[[int], None] | None,
        calibration: Any,
    ) -> ConvertResult:  # fmt: skip
        rec = self.plan.recipe
        recorded = rec.calibrates and (calibration is not None or rec.records_rtn)
        record = calibration_record(calibration) if recorded else None
        digest = self.plan.digest(self.source.fingerprint + json.dumps(record, sort_keys=True))
        guard = SourceGuard.record(self.source)
        finished = self.tx.finished(digest, overwrite)
        if finished is not None:
            return ConvertResult(self.plan, finished, len(self.plan.jobs), already_complete=True)
        if not (self.work / MANIFEST_NAME).exists():  # before anything is written:
            check_target(self.tx.out, self.work, artifact_names(self.plan, self.source))
            self._check_space()
        done = self.tx.resume_or_start(digest, overwrite, guard.ids, self._stale, len(self.plan.jobs))  # fmt: skip
        if not (self.work / MANIFEST_NAME).exists():  # else only the move into OUTPUT is left
            done = self.tx.work.open_files(self.plan, done)
            digests = self._run(done, workers, guard, progress, calibration)
            t0 = time.perf_counter()
            build(self.source, self.plan, self.work, digest, record, guard, digests)
            self.timings["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = self.tx.move_in()
        self.timings["move_in_s"] = time.perf_counter() - t0
        log.debug("timings %s", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in self.timings.items()}))  # fmt: skip
        return ConvertResult(self.plan, manifest, len(done))

    def _stale(self, changed: set[str]) -> set[int]:
        """The jobs that read a source file of ``changed``."""
        return {j.id for j in self.plan.jobs if job_files(self.source, j) & changed}

    def _run(
        self, done: set[int], workers: int, guard: SourceGuard,
        progress: Callable[[int], None] | None, calibration: Any,
    ) -> dict[str, dict[str, Any]]:  # fmt: skip
        """Run the jobs not ``done``, journaling each; the containers' digests (``hashing``)."""
        width = hash_threads()
        hashes = container_hashes(self.plan, self.work, width)
        todo = [j for j in self.plan.jobs if j.id not in done]
        by_id = {j.id: j for j in todo}
        if done:  # a fresh run stays quiet: a bad-input error must be the only line on stderr
            log.info("%d jobs, %d already done (resume)", len(self.plan.jobs), len(done))
        try:
            for job in self.plan.jobs:
                if job.id in done:
                    hashes.written(job)
            t0 = time.perf_counter()
            self.timings["jobs_started"] = time.time()
            order = fill_order(self.plan, todo, fill_width(width, workers, self.work))
            jobs = run_jobs(self.source, self.plan, self.work, order, workers, guard, progress, calibration, hashes.start, self.timings, hashes.hashed_elsewhere)  # fmt: skip
            for job_id in self.tx.journal(jobs):
                hashes.written(by_id[job_id])
            t1 = time.perf_counter()
            total = max(1, sum(f.size for f in self.plan.files))
            self.timings["hashed_at_jobs_end"] = hashes.hashed_bytes() / total
            self.timings["hashed_by_workers"] = hashes.worker_bytes / total
            digests = hashes.finish()
            self.timings.update(jobs_s=t1 - t0, hash_tail_s=time.perf_counter() - t1)
            self.timings.update(hashes.writeback_stats())
            return digests
        finally:
            hashes.close()

    def space_needed(self) -> int:
        extra = [json_size(doc) for doc in metadata_docs(self.plan, self.source).values()]
        extra += [
            (self.source.root / n).stat().st_size
            for n in carried_files(self.plan, self.source).names
        ]
        extra.append(_MANIFEST_BYTES_PER_FILE * (len(self.plan.files) + len(extra)) + (64 << 10))
        return space_needed(self.plan.files, self.work, extra)

    def files_needed(self) -> int:
        """Files (inodes) still to create: the artifact's, and the work directory's own."""
        names = artifact_names(self.plan, self.source)
        return sum(not (self.work / n).exists() for n in names) + _SCRATCH_FILES

    def _check_space(self) -> None:
        need, free = self.space_needed(), free_bytes(self.work)
        if need > free:
            raise space_error(self.tx.out, need, free, early=True)
        files, inodes = self.files_needed(), free_inodes(self.work)
        if inodes is not None and files > inodes:
            raise inode_error(self.tx.out, files, inodes, early=True)

    def disk_full(self) -> HetquantError:
        out = self.tx.out
        try:
            need, free = self.space_needed(), free_bytes(self.work)
            files, inodes = self.files_needed(), free_inodes(self.work)
        except OSError:
            return HetquantError(f"OUTPUT {out}: no space left on the device; free some and re-run the same command to resume")  # fmt: skip
        if inodes is not None and (inodes == 0 or (need <= free and files > inodes)):
            return inode_error(out, files, inodes, early=False)
        return space_error(out, need, free, early=False)
