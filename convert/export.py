"""``hetquant export ARTIFACT OUT --to NAME``: an artifact's CPU experts in another engine's layout.

The same machinery as a convert (``engine.py``), with the artifact's ``cpu_experts`` part as the
source and an exporter (``exporters.py``) as the recipe:

- plan: the artifact's manifest and the layer files' headers give each MoE layer's format and
  dims (:class:`~hetquant.convert.exporters.ExpertLayer`); the exporter checks them (bad input:
  one ``HetquantError`` naming the layer, before anything is written) and names every output
  tensor; the outputs become containers (``planning/containers.py``: ``raw`` for kt's ``.kt`` files,
  ``safetensors``), one job per (layer, expert) owning its byte ranges;
- execute: OUTPUT locked (``fs/lock.py``), free space checked against the plan's sizes, the
  containers created at their final size in ``OUTPUT/.hetquant-partial/`` (``fs/workdir.py``), the
  jobs' bytes written with ``PieceWriter`` and journaled, the source files guarded
  (``fs/source_guard.py``: a layer file changed under a job is an error, and on resume its jobs
  are redone); re-running after an interruption resumes, re-running a finished export says so;
- finish: every file hashed into ``hetquant.json`` (written last, ``complete: true``) whose
  ``export`` entry records the target, the NUMA count and the layers, from which ``hetquant
  verify`` replays the plan (:func:`replay_export`); then the files are moved into OUTPUT.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME
from hetquant.formats.int4_cpu import LAYER_KEYS
from hetquant.formats.safetensors_io import MappedFile, read_header

from .engine import check_paths, finished_manifest, only_lock_left, refuse_foreign
from .execute import Stopped, stop_on_signals
from .exporters import ExpertLayer, Exporter, get_exporter
from .fs.diskspace import free_bytes, space_error, space_needed
from .fs.lock import OutputLock
from .fs.os_errors import os_error
from .fs.source_guard import SourceGuard
from .fs.workdir import JOURNAL, WorkDir
from .manifest import SCHEMA_VERSION, digest_files, hetquant_version, write_json_atomic
from .planning.containers import Container, OutTensor, make_container
from .planning.plan import OutPiece
from .transaction import check_target, move_in
from .writer import PieceWriter

__all__ = ["ExportJob", "ExportPlan", "ExportResult", "export", "plan_export", "replay_export"]

log = logging.getLogger("hetquant.convert")


@dataclass(frozen=True)
class ExportJob:
    """Expert ``expert`` of ``layers[layer]``: its outputs (whole tensors of their files)."""

    id: int
    layer: int  # index into ExportPlan.layers
    expert: int
    outputs: tuple[OutPiece, ...]


@dataclass
class ExportPlan:
    exporter: Exporter
    numa: int
    layers: list[ExpertLayer]
    files: list[Container]
    jobs: list[ExportJob]

    def file_of(self) -> dict[str, Container]:
        """Output tensor name → the file holding it."""
        return {t.name: f for f in self.files for t in f.tensors}

    def record(self) -> dict[str, Any]:
        """The manifest's ``export`` entry: enough to replay this plan without the source."""
        return {
            "to": self.exporter.name,
            "numa": self.numa,
            "layers": [dataclasses.asdict(x) for x in self.layers],
        }

    def digest(self, fingerprint: str) -> str:
        doc = {"fingerprint": fingerprint, **self.record(),
               "files": [[f.name, f.layout_digest()] for f in self.files]}  # fmt: skip
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def plan_export(layers: list[ExpertLayer], exporter: Exporter, numa: int) -> ExportPlan:
    """Every file, tensor and job of exporting ``layers`` (shape-only; checks them first)."""
    if not layers:
        raise HetquantError("export: the artifact has no CPU expert layers")
    for layer in layers:
        exporter.check(layer, numa)
    files: dict[str, Container] = {}
    jobs: list[ExportJob] = []
    for idx, layer in enumerate(layers):
        for e in range(layer.num_experts):
            pieces = []
            for out in exporter.outputs(layer, numa, e):
                f = files.get(out.file)
                if f is None:
                    f = files[out.file] = make_container(
                        exporter.container, out.file, exporter.name
                    )
                f.tensors.append(OutTensor(out.tensor, out.meta))
                pieces.append(OutPiece(out.tensor, out.key, 0, out.meta))
            jobs.append(ExportJob(len(jobs), idx, e, tuple(pieces)))
    return ExportPlan(exporter, numa, layers, list(files.values()), jobs)


def replay_export(manifest: dict[str, Any]) -> ExportPlan:
    """The plan of an export, rebuilt from its manifest's ``export`` entry (``hetquant verify``)."""
    rec = manifest["export"]
    layers = [ExpertLayer(**x) for x in rec["layers"]]
    return plan_export(layers, get_exporter(rec["to"]), int(rec["numa"]))


def source_layers(artifact: Path) -> list[ExpertLayer]:
    """The MoE layers of ``artifact``'s cpu_experts part (manifest and headers; refuses an
    artifact without one, and one whose stored tensors disagree with its config.json:
    ``runtime/loading/conformance.py``)."""
    from hetquant.runtime.experts._expert_files import _select_layers
    from hetquant.runtime.loading.loader import open_artifact

    open_artifact(artifact)
    out = []
    for info in _select_layers(artifact, None).values():  # paths: artifact / name, kept inside
        params = dataclasses.asdict(info.fmt)  # type: ignore[call-overload]  # e.g. group_size
        out.append(ExpertLayer(info.layer, str(info.path.relative_to(artifact)), info.prefix,
                               info.fmt.name, params, info.num_experts, info.hidden, info.inter))  # fmt: skip
    return out


@dataclass
class ExportResult:
    plan: ExportPlan
    manifest: dict[str, Any]
    already_complete: bool = False


def export(
    artifact: Path, output: Path, to: str, *, numa: int = 1, overwrite: bool = False
) -> ExportResult:
    """Export ``artifact``'s CPU experts into ``output`` in layout ``to`` (module docstring)."""
    artifact, output = artifact.resolve(), output.resolve()
    check_paths(artifact, output)
    plan = plan_export(source_layers(artifact), get_exporter(to), numa)
    files = sorted({x.file for x in plan.layers} | {MANIFEST_NAME})
    guard = SourceGuard.of_files(artifact, files)
    fingerprint = hashlib.sha256((artifact / MANIFEST_NAME).read_bytes()).hexdigest()
    digest = plan.digest(fingerprint)
    lock = OutputLock(output)
    work = WorkDir(lock.work)
    try:
        with stop_on_signals():
            refuse_foreign(output)
            lock.acquire()
            done = finished_manifest(output, artifact, digest, overwrite, work.digest())
            if done is not None:
                work.clear()
                return ExportResult(plan, done, already_complete=True)
            return _Run(artifact, output, plan, work, guard, digest, fingerprint).execute(overwrite)
    except Stopped as s:
        raise HetquantError(
            f"interrupted by {s}: finished jobs are journaled in {lock.work}; re-run the same "
            "command to resume"
        ) from None
    except OSError as e:
        raise os_error(e) from e
    finally:
        lock.release(remove=only_lock_left(lock.work))


@dataclass
class _Run:
    artifact: Path
    out: Path
    plan: ExportPlan
    work: WorkDir
    guard: SourceGuard
    digest: str
    fingerprint: str

    def execute(self, overwrite: bool) -> ExportResult:
        if not (self.work.path / MANIFEST_NAME).exists():
            check_target(self.out, self.work.path, dict.fromkeys(f.name for f in self.plan.files))
            need = space_needed(self.plan.files, self.work.path, [64 << 10])
            if need > (free := free_bytes(self.work.path)):
                raise space_error(self.out, need, free, early=True)
            done = self._resume_or_start(overwrite)
            done = self.work.open_files(self.plan, done)  # type: ignore[arg-type]
            self._run(done)
            self._build()
        manifest = move_in(self.out, self.work.path)
        self.work.clear()
        return ExportResult(self.plan, manifest)

    def _resume_or_start(self, overwrite: bool) -> set[int]:
        then = self.work.digest()
        if then != self.digest:
            if then is not None and not overwrite:
                raise HetquantError(
                    f"OUTPUT {self.out} holds an interrupted export or convert with other "
                    "options; re-run that command to resume it, or pass --overwrite"
                )
            self.work.start(self.digest, self.guard.ids)
            return set()
        done = self.work.done()
        changed = {f for f, i in self.guard.ids.items() if self.work.recorded_ids().get(f) != i}
        if changed:  # a layer file replaced since: redo its jobs
            stale = {j.id for j in self.plan.jobs if self.plan.layers[j.layer].file in changed}
            done -= stale
            self.work.keep_only(self.digest, done, self.guard.ids)
        if done:
            log.info("%d jobs, %d already done (resume)", len(self.plan.jobs), len(done))
        return done

    def _run(self, done: set[int]) -> None:
        maps: dict[str, MappedFile] = {}
        entries: dict[str, Any] = {}
        writer = PieceWriter(self.plan.files, self.work.path)
        try:
            with open(self.work.path / JOURNAL, "a") as journal:
                for job in self.plan.jobs:
                    if job.id in done:
                        continue
                    layer = self.plan.layers[job.layer]
                    self.guard.check({layer.file})
                    if layer.file not in maps:
                        maps[layer.file] = MappedFile(self.artifact / layer.file)
                        entries[layer.file] = read_header(self.artifact / layer.file).entries
                    expert = {k: maps[layer.file].view(entries[layer.file][f"{layer.prefix}.{k}"])[job.expert]
                              for k in LAYER_KEYS}  # fmt: skip
                    data = self.plan.exporter.convert(layer, self.plan.numa, expert)
                    for piece in job.outputs:
                        writer.write(piece.tensor, piece.offset, data[piece.key])
                    self.guard.check({layer.file})
                    journal.write(f"{job.id}\n")
                    journal.flush()
        finally:
            writer.close()

    def _build(self) -> None:
        for f in self.plan.files:
            with open(self.work.path / f.name, "rb+") as fh:
                os.fsync(fh.fileno())
        self.guard.check()
        names = [f.name for f in self.plan.files]
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "hetquant_version": hetquant_version(),
            "complete": True,
            "export": self.plan.record(),
            "source": {"path": str(self.artifact), "fingerprint": self.fingerprint},
            "plan_digest": self.digest,
            "parts": {self.plan.exporter.name: {"files": names}},
            "files": digest_files({n: self.work.path / n for n in names}),
        }
        write_json_atomic(self.work.path / MANIFEST_NAME, manifest)
