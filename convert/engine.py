"""Plan → validate → execute, resumable: the body of ``hetquant convert``.

Output files are built under ``OUTPUT/.hetquant-partial/``: each is created with its final header
and size, jobs write their byte ranges, and a journal records finished jobs. Re-running the same
command (same source, recipe and options → same plan digest) skips journaled jobs and redoes the
rest, giving byte-identical files. When every job is done, files are fsynced and renamed into
place, the index, config and tokenizer files follow, and ``hetquant.json`` is written last.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.filenames import INDEX_NAME, MANIFEST_NAME, PARTIAL_DIR

from .jobs import JobRunner
from .manifest import build_manifest, file_digest, write_json_atomic
from .plan import Job, Plan, SourceItem, make_plan
from .recipes import ROOT, Recipe
from .recipes.metadata import artifact_metadata
from .source import SourceCheckpoint

__all__ = ["AUX_PATTERNS", "ConvertResult", "convert", "plan_for"]

log = logging.getLogger("hetquant.convert")

CALIBRATION_DIR = "calibration"
JOURNAL = "journal"
AUX_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "generation_config.json", "configuration_*.py", "modeling_*.py", "LICENSE*",
)  # fmt: skip


@dataclass
class ConvertResult:
    plan: Plan
    manifest: dict[str, Any] | None
    resumed_jobs: int


def plan_for(source: SourceCheckpoint, recipe: Recipe, max_shard_size: int) -> Plan:
    items = [SourceItem(t.name, t.role, t.dtype, t.fmt_name) for t in source.tensors.values()]
    return make_plan(items, recipe, max_shard_size)


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
) -> ConvertResult:
    """Convert ``source`` into the artifact directory ``output`` (see module docstring).

    ``calibration`` (a ``calib.CalibrationResult``): AWQ transforms applied to the weights,
    norms and routers it covers before they are quantized or copied; part of the plan's identity.
    """
    output = output.resolve()
    _check_paths(source.root, output)
    plan = plan_for(source, recipe, max_shard_size)
    if calibration is not None and not recipe.calibrates:
        raise HetquantError(f"recipe {recipe.name} does not calibrate; drop --calib-data")
    record = calibration_record(calibration) if recipe.calibrates else None
    digest = plan.digest(source.fingerprint + json.dumps(record, sort_keys=True))
    work = _prepare_output(output, digest, overwrite)
    if calibration is not None and workers > 1:
        calibration.save(work / CALIBRATION_DIR)  # worker processes load it lazily
    done = _open_work_files(plan, work)
    todo = [j for j in plan.jobs if j.id not in done]
    if done:  # a fresh run stays quiet: a bad-input error must be the only line on stderr
        log.info("%d jobs, %d already done (resume)", len(plan.jobs), len(done))
    with open(work / JOURNAL, "a") as journal:
        for job_id in _run_jobs(source, plan, work, todo, workers, progress, calibration):
            journal.write(f"{job_id}\n")
            journal.flush()
    manifest = _finalize(source, plan, output, work, digest, record)
    return ConvertResult(plan, manifest, len(done))


def calibration_record(calibration: Any) -> dict[str, Any]:
    """What the manifest says about calibration: deterministic fields only (no timings)."""
    if calibration is None:
        return {"method": "rtn"}
    stats = calibration.stats
    return {
        "method": calibration.options.method,
        "tokens": stats["tokens"],
        "options": calibration.options.to_dict(),
        "fallback_experts": stats.get("fallback_experts", {}),
        "mtp": "rtn",  # the MTP layer has no forward to calibrate through
    }


def _check_paths(src: Path, out: Path) -> None:
    if out == src or out.is_relative_to(src):
        raise HetquantError(
            f"OUTPUT {out} is inside SOURCE {src}; the source is never written — choose another OUTPUT"
        )
    if src.is_relative_to(out):
        raise HetquantError(f"SOURCE {src} is inside OUTPUT {out}; choose another OUTPUT")


def _prepare_output(out: Path, digest: str, overwrite: bool) -> Path:
    """Create or resume ``out``; returns the work directory."""
    work = out / PARTIAL_DIR
    ours = (out / MANIFEST_NAME).exists() or work.exists()
    if out.exists() and any(out.iterdir()):
        journal_digest = _journal_digest(work)
        if overwrite:
            if not ours:
                raise HetquantError(
                    f"OUTPUT {out} is not empty and not a hetquant artifact; refusing to delete it even with --overwrite"
                )
            shutil.rmtree(out)
        elif (out / MANIFEST_NAME).exists():
            shutil.rmtree(work, ignore_errors=True)  # scratch left by a kill after the manifest
            raise HetquantError(
                f"OUTPUT {out} already holds an artifact; pass --overwrite to replace it"
            )
        elif journal_digest == digest:
            return work
        elif journal_digest is not None:
            raise HetquantError(
                f"OUTPUT {out} holds an interrupted convert with a different source, recipe or options; re-run that command to resume it, or pass --overwrite"
            )
        else:
            raise HetquantError(
                f"OUTPUT {out} exists and is not empty; choose a new directory or pass --overwrite"
            )
    work.mkdir(parents=True, exist_ok=True)
    with open(work / JOURNAL, "w") as f:
        f.write(f"plan {digest}\n")
    return work


def _journal_digest(work: Path) -> str | None:
    try:
        first = (work / JOURNAL).read_text().split("\n", 1)[0]
    except FileNotFoundError:
        return None
    return first.removeprefix("plan ") if first.startswith("plan ") else None


def _open_work_files(plan: Plan, work: Path) -> set[int]:
    """Create missing/mismatched work files; return ids of jobs whose output is intact."""
    lines = (work / JOURNAL).read_text().splitlines()[1:]
    done = {int(x) for x in lines if x.strip().isdigit()}
    file_of = plan.file_of()
    for f in plan.files:
        path = work / f.name
        final = work.parent / f.name
        if final.exists() and not path.exists():
            continue  # renamed during an interrupted finalization
        if not f.intact(path):
            f.create(path)
            done -= {j.id for j in plan.jobs if any(file_of[o.tensor] is f for o in j.outputs)}
    return done


# execution ---------------------------------------------------------------------------------------
_WORKER: JobRunner | None = None


def _worker_init(
    source_root: str, revision: str | None, recipe: Recipe, max_shard_size: int, work: str
) -> None:
    global _WORKER
    import torch

    torch.set_num_threads(1)
    source = SourceCheckpoint.open(source_root, revision)
    calibration = None
    if (Path(work) / CALIBRATION_DIR).exists():
        from hetquant.calib.calibrate import CalibrationResult

        calibration = CalibrationResult.load(Path(work) / CALIBRATION_DIR)
    # The plan is rebuilt here, not sent: it holds role-table lambdas, which cannot be pickled.
    _WORKER = JobRunner(source, plan_for(source, recipe, max_shard_size), Path(work), calibration)


def _worker_run(job: Job) -> tuple[int, int]:
    assert _WORKER is not None
    return job.id, _WORKER.run(job)


def _run_jobs(
    source: SourceCheckpoint, plan: Plan, work: Path, todo: list[Job], workers: int,
    progress: Callable[[int], None] | None, calibration: Any = None,
) -> Iterable[int]:  # fmt: skip
    if workers <= 1 or len(todo) <= 1:
        runner = JobRunner(source, plan, work, calibration)
        threads = torch.get_num_threads()
        # One thread, as in the pool's workers: jobs are block-row sized, and per-op thread
        # teams cost more than they save (benchmarks/README.md, bf16 convert).
        torch.set_num_threads(1)
        try:
            for job in todo:
                nbytes = runner.run(job)
                if progress:
                    progress(nbytes)
                yield job.id
        finally:
            runner.close()
            torch.set_num_threads(threads)
        return
    ctx = get_context("spawn")
    args = (str(source.root), source.revision, plan.recipe, plan.max_shard_size, str(work))
    order = sorted(todo, key=lambda j: -j.nbytes)  # big jobs first: better balance
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_worker_init, initargs=args
    ) as pool:
        for job_id, nbytes in pool.map(_worker_run, order, chunksize=1):
            if progress:
                progress(nbytes)
            yield job_id


# finalization ------------------------------------------------------------------------------------
def _finalize(
    source: SourceCheckpoint, plan: Plan, out: Path, work: Path, digest: str,
    calibration: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    for f in plan.files:
        tmp, final = work / f.name, out / f.name
        if tmp.exists():
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
    root_files = [f for f in plan.files if f.part == ROOT]
    index = {
        "metadata": {"total_size": sum(f.data_size for f in root_files)},
        "weight_map": {t.name: f.name for f in root_files for t in f.tensors},
    }
    write_json_atomic(out / INDEX_NAME, index)
    config, extra = artifact_metadata(plan, source.config.raw)
    write_json_atomic(out / "config.json", config)
    for name, doc in extra.items():
        write_json_atomic(out / name, doc)
    aux = _copy_aux(source.root, out)
    names = [f.name for f in plan.files] + [INDEX_NAME, "config.json", *sorted(extra), *aux]
    files = {n: file_digest(out / n) for n in names}
    parts: dict[str, list[str]] = {}
    for f in plan.files:
        parts.setdefault(f.part, []).append(f.name)
    parts[ROOT] += [INDEX_NAME, "config.json", *sorted(extra), *aux]
    src_doc = {
        "path": str(source.root),
        "fingerprint": source.fingerprint,
        "revision": source.revision,
        "repo_id": source.repo_id,
        "bytes": source.total_bytes,
        "dtypes": {i.role.role.name: i.dtype for i in plan.items},
        "formats": {i.role.role.name: i.fmt for i in plan.items},
    }
    manifest = build_manifest(plan, src_doc, files, parts, digest)
    if calibration is not None:
        manifest["calibration"] = calibration
    write_json_atomic(out / MANIFEST_NAME, manifest)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _copy_aux(src: Path, out: Path) -> list[str]:
    names = sorted({p.name for pat in AUX_PATTERNS for p in src.glob(pat) if p.is_file()})
    for n in names:
        tmp = out / f".{n}.tmp"
        shutil.copyfile(src / n, tmp)
        os.replace(tmp, out / n)
    return names
