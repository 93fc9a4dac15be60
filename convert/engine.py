"""Plan → validate → execute, resumable and safe to interrupt: the body of ``hetquant convert``.

One convert at a time holds OUTPUT (``fs/lock.py``). The work happens in
``OUTPUT/.hetquant-partial/`` (``fs/workdir.py``): containers are created at their final size (space
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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME, PARTIAL_DIR
from hetquant.formats.manifest_schema import read_manifest

from .execute import Stopped, run_jobs, sigbus_exits, stop_on_signals
from .finalize import artifact_names, build, carried_files, json_size, metadata_docs, move_in
from .fs.diskspace import free_bytes, free_inodes, inode_error, space_error, space_needed
from .fs.lock import LOCK_NAME, OutputLock
from .fs.os_errors import DISK_FULL, os_error
from .fs.source_guard import SourceGuard, job_files
from .fs.workdir import JOURNAL, WorkDir
from .hashing import FileHashes, fill_order, hash_threads
from .planning.plan import Plan, plan_for
from .planning.source import SourceCheckpoint
from .recipes import Recipe
from .transaction import check_target

__all__ = [
    "ConvertResult",
    "calibration_record",
    "check_paths",
    "convert",
    "finished_manifest",
    "only_lock_left",
    "plan_for",
    "refuse_foreign",
]

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
) -> ConvertResult:
    """Convert ``source`` into the artifact directory ``output`` (see module docstring).

    ``calibration`` (a ``calib.CalibrationResult``), or ``calibrate`` returning one once OUTPUT is
    locked: AWQ transforms applied to the weights, norms and routers it covers before they are
    quantized or copied; part of the plan's identity.
    """
    output = output.resolve()
    check_paths(source.root, output)
    if (calibration is not None or calibrate is not None) and not recipe.calibrates:
        raise HetquantError(f"recipe {recipe.name} does not calibrate; drop --calib-data")
    entered = time.time()
    plan = plan_for(source, recipe, max_shard_size)
    lock = OutputLock(output)
    run = _Run(source, plan, output, WorkDir(lock.work))
    run.timings.update(entered=entered, plan_s=time.time() - entered)
    try:
        with stop_on_signals(), sigbus_exits(_SIGBUS_MESSAGE.format(root=source.root)):
            refuse_foreign(output)
            lock.acquire()
            if calibrate is not None:
                calibration = calibrate()
            return run.execute(workers, overwrite, progress, calibration)
    except Stopped as s:
        raise HetquantError(
            f"interrupted by {s}: {run.journaled} of {len(plan.jobs)} jobs are done and journaled "
            f"in {lock.work}; re-run the same command to resume"
        ) from None
    except OSError as e:
        if e.errno in DISK_FULL:
            raise run.disk_full() from e
        raise os_error(e) from e
    finally:
        lock.release(remove=only_lock_left(lock.work))


_SIGBUS_MESSAGE = (
    "SOURCE {root} changed during conversion: a shard was truncated while it was being read "
    "(SIGBUS); no manifest was written — once the source is complete and stable, re-run the same "
    "command to resume"
)


def calibration_record(calibration: Any) -> dict[str, Any]:
    """What the manifest says about calibration: deterministic fields only (no timings).
    ``options.quantizer``: the target format(s) of the calibrated linears (one name, or a list),
    left out when it is awq_w4a16 alone — the key that ct-w4a16's calibrated manifests (and their
    golden bytes) have carried since before the quantizer seam, and awq-w4a16's never did."""
    if calibration is None:
        return {"method": "rtn"}
    stats = calibration.stats
    options = _applied(calibration.options.to_dict())
    formats = sorted({calibration.quantizer(n).fmt.name for n in calibration.quantized})
    if formats != ["awq_w4a16"]:  # awq-w4a16's: unsaid, as in manifests made before others
        options["quantizer"] = formats[0] if len(formats) == 1 else formats
    return {
        "method": calibration.options.method,
        "tokens": stats["tokens"],
        "options": options,
        "fallback_experts": stats.get("fallback_experts", {}),
        "mtp": "rtn",  # the MTP layer has no forward to calibrate through
        "compute": _compute_record(stats["device"], stats["dtype"]),
    }


def _compute_record(device: str, dtype: str) -> dict[str, Any]:
    """Where calibration ran and whether another machine gets the same bytes: on the CPU in
    float64 every CPU does (``calib/awq.py``, "Reproducibility"); an accelerator's BF16 matmuls
    give other transforms (README, "Reproducible calibration": the measured difference)."""
    kind = device.split(":")[0]
    return {
        "device": kind,
        "dtype": dtype,
        "same_bytes_on_every_cpu": kind == "cpu" and dtype == "float64",
    }


_OFF_UNLESS = {"gptq": ("gptq", "gptq_damp", "gptq_act_order", "gptq_sequential"),
               "act_aware": ("act_aware",)}  # fmt: skip


def _applied(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the settings of a step that did not run (GPTQ, the W8A8-aware
    search when off): a manifest says what was done, and those made before the steps existed
    keep their bytes."""
    for switch, keys in _OFF_UNLESS.items():
        if not options.get(switch):
            options = {k: v for k, v in options.items() if k not in keys}
    return options


@dataclass
class _Run:
    """One convert into ``out`` with OUTPUT locked."""

    source: SourceCheckpoint
    plan: Plan
    out: Path
    work: WorkDir
    journaled: int = 0
    timings: dict[str, Any] = field(default_factory=dict)  # logged at debug level

    def execute(
        self,
        workers: int,
        overwrite: bool,
        progress: Callable[[int], None] | None,
        calibration: Any,
    ) -> ConvertResult:
        rec = self.plan.recipe
        recorded = rec.calibrates and (calibration is not None or rec.records_rtn)
        record = calibration_record(calibration) if recorded else None
        digest = self.plan.digest(self.source.fingerprint + json.dumps(record, sort_keys=True))
        guard = SourceGuard.record(self.source)
        finished = finished_manifest(
            self.out, self.source.root, digest, overwrite, self.work.digest()
        )
        if finished is not None:
            self.work.clear()  # scratch left by a kill after the manifest was written
            return ConvertResult(self.plan, finished, len(self.plan.jobs), already_complete=True)
        if not (self.work.path / MANIFEST_NAME).exists():  # before anything is written:
            check_target(self.out, self.work.path, artifact_names(self.plan, self.source))
            self._check_space()
        done = self._resume_or_start(digest, overwrite, guard)
        if not (self.work.path / MANIFEST_NAME).exists():  # else only the move into OUTPUT is left
            done = self.work.open_files(self.plan, done)
            digests = self._run(done, workers, guard, progress, calibration)
            t0 = time.perf_counter()
            build(self.source, self.plan, self.work.path, digest, record, guard, digests)
            self.timings["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = move_in(self.out, self.work.path)
        self.work.clear()
        self.timings["move_in_s"] = time.perf_counter() - t0
        log.debug("timings %s", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in self.timings.items()}))  # fmt: skip
        return ConvertResult(self.plan, manifest, len(done))

    def _resume_or_start(self, digest: str, overwrite: bool, guard: SourceGuard) -> set[int]:
        """Journaled jobs to trust (resume), or a fresh start; refuses what it may not touch."""
        journal_digest = self.work.digest()
        if journal_digest != digest:
            if journal_digest is not None and not overwrite:
                raise HetquantError(
                    f"OUTPUT {self.out} holds an interrupted convert with a different source, "
                    "recipe or options; re-run that command to resume it, or pass --overwrite"
                )
            self.work.start(digest, guard.ids)
            return set()
        done = self.work.done()
        then, now = self.work.recorded_ids(), guard.ids
        changed = {f for f in then.keys() | now.keys() if then.get(f) != now.get(f)}
        if changed:
            stale = {j.id for j in self.plan.jobs if job_files(self.source, j) & changed}
            log.info("%d source file(s) changed since the interrupted run; redoing the %d jobs that read them", len(changed), len(stale & done))  # fmt: skip
            done -= stale
            (self.work.path / MANIFEST_NAME).unlink(missing_ok=True)
            self.work.keep_only(digest, done, now)
        return done

    def _run(
        self, done: set[int], workers: int, guard: SourceGuard,
        progress: Callable[[int], None] | None, calibration: Any,
    ) -> dict[str, dict[str, Any]]:  # fmt: skip
        """Run the jobs not ``done``, journaling each; the containers' digests (``hashing``)."""
        width = hash_threads()
        hashes = FileHashes(self.plan, self.work.path, width)
        todo = [j for j in self.plan.jobs if j.id not in done]
        by_id = {j.id: j for j in todo}
        self.journaled = len(done)
        if done:  # a fresh run stays quiet: a bad-input error must be the only line on stderr
            log.info("%d jobs, %d already done (resume)", len(self.plan.jobs), len(done))
        try:
            for job in self.plan.jobs:
                if job.id in done:
                    hashes.written(job)
            t0 = time.perf_counter()
            self.timings["jobs_started"] = time.time()
            order = fill_order(self.plan, todo, width)
            jobs = run_jobs(self.source, self.plan, self.work.path, order, workers, guard, progress, calibration, hashes.start, self.timings)  # fmt: skip
            with open(self.work.path / JOURNAL, "a") as journal:
                for job_id in jobs:
                    journal.write(f"{job_id}\n")
                    journal.flush()
                    self.journaled += 1
                    hashes.written(by_id[job_id])
            t1 = time.perf_counter()
            self.timings["hashed_at_jobs_end"] = hashes.hashed_bytes() / max(1, sum(f.size for f in self.plan.files))  # fmt: skip
            digests = hashes.finish()
            self.timings.update(jobs_s=t1 - t0, hash_tail_s=time.perf_counter() - t1)
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
        return space_needed(self.plan.files, self.work.path, extra)

    def files_needed(self) -> int:
        """Files (inodes) still to create: the artifact's, and the work directory's own."""
        names = artifact_names(self.plan, self.source)
        return sum(not (self.work.path / n).exists() for n in names) + _SCRATCH_FILES

    def _check_space(self) -> None:
        need, free = self.space_needed(), free_bytes(self.work.path)
        if need > free:
            raise space_error(self.out, need, free, early=True)
        files, inodes = self.files_needed(), free_inodes(self.work.path)
        if inodes is not None and files > inodes:
            raise inode_error(self.out, files, inodes, early=True)

    def disk_full(self) -> HetquantError:
        try:
            need, free = self.space_needed(), free_bytes(self.work.path)
            files, inodes = self.files_needed(), free_inodes(self.work.path)
        except OSError:
            return HetquantError(f"OUTPUT {self.out}: no space left on the device; free some and re-run the same command to resume")  # fmt: skip
        if inodes is not None and (inodes == 0 or (need <= free and files > inodes)):
            return inode_error(self.out, files, inodes, early=False)
        return space_error(self.out, need, free, early=False)


def check_paths(src: Path, out: Path) -> None:
    if out == src or out.is_relative_to(src):
        raise HetquantError(
            f"OUTPUT {out} is inside SOURCE {src}; the source is never written — choose another OUTPUT"
        )
    if src.is_relative_to(out):
        raise HetquantError(f"SOURCE {src} is inside OUTPUT {out}; choose another OUTPUT")


def refuse_foreign(out: Path) -> None:
    """OUTPUT must be a directory that is empty, or holds a hetquant artifact or work."""
    if out.exists() and not out.is_dir():
        raise HetquantError(f"OUTPUT {out} is a file, not a directory; choose a directory")
    ours = (out / MANIFEST_NAME).exists() or (out / PARTIAL_DIR).exists()
    if out.exists() and not ours and any(out.iterdir()):
        raise HetquantError(
            f"OUTPUT {out} is not empty and not a hetquant artifact; choose a new or empty "
            "directory (it is never deleted, even with --overwrite)"
        )


def finished_manifest(
    out: Path, source: Path, digest: str, overwrite: bool, journal_digest: str | None
) -> dict[str, Any] | None:
    """The manifest of a complete artifact of this very plan and source directory in ``out``
    (None: work to do); refuses another artifact unless ``overwrite``."""
    if not (out / MANIFEST_NAME).exists():
        return None
    try:
        manifest = read_manifest(out)
    except HetquantError:  # damaged: another artifact, as far as this convert can tell
        manifest = {}
    if overwrite:
        return None
    same = isinstance(manifest, dict) and manifest.get("plan_digest") == digest
    same = same and manifest.get("source", {}).get("path") == str(source)
    if same and manifest.get("complete") is True and _sizes_hold(out, manifest):
        return manifest
    why = "a damaged artifact (run `hetquant verify`)" if same else "an artifact of another source, recipe or options"  # fmt: skip
    resumable = " (an interrupted --overwrite of it is kept: pass --overwrite to resume it)" if journal_digest == digest else ""  # fmt: skip
    raise HetquantError(
        f"OUTPUT {out} already holds {why}; pass --overwrite to replace it{resumable}"
    )


def _sizes_hold(out: Path, manifest: dict[str, Any]) -> bool:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all((out / n).stat().st_size == f["size"] for n, f in files.items())
    except (OSError, TypeError, KeyError):
        return False


def only_lock_left(work: Path) -> bool:
    try:
        return set(os.listdir(work)) <= {LOCK_NAME}
    except FileNotFoundError:
        return True
    except OSError:  # unreadable: keep whatever is there
        return False
