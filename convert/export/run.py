"""``hetquant export ARTIFACT OUT --to NAME``: an artifact's CPU experts in another engine's layout.

The same machinery as a convert, with the artifact's ``cpu_experts`` part as the source and an
exporter (``exporters.py``) as the recipe: the plan (``plan.py``); OUTPUT held as a transaction
(``engine/transaction.py``: lock, signals, OS errors, resume, the move into OUTPUT); free space
checked against the plan's sizes, the containers created at their final size in the work
directory, the jobs' bytes written with ``PieceWriter`` and journaled, the source files guarded
(``fs/source_guard.py``: a layer file changed under a job is an error, and on resume its jobs are
redone); then every file hashed into ``hetquant.json`` (written last, ``complete: true``), whose
``export`` entry records the target, the NUMA count and the layers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetquant.formats.file_digests import FILE_DIGEST
from hetquant.formats.filenames import MANIFEST_NAME
from hetquant.formats.int4_cpu import LAYER_KEYS
from hetquant.formats.safetensors_io import MappedFile, read_header

from ..engine.manifest import SCHEMA_VERSION, digest_files, hetquant_version, write_json_atomic
from ..engine.transaction import Transaction, check_target
from ..engine.writer import PieceWriter
from ..fs.diskspace import free_bytes, space_error, space_needed
from ..fs.source_guard import SourceGuard
from .exporters import ExpertLayer, get_exporter
from .plan import ExportPlan, plan_export

__all__ = ["ExportResult", "export", "source_layers"]

log = logging.getLogger("hetquant.convert")


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
    artifact = artifact.resolve()
    tx = Transaction(artifact, output.resolve())
    plan = plan_export(source_layers(artifact), get_exporter(to), numa)
    files = sorted({x.file for x in plan.layers} | {MANIFEST_NAME})
    guard = SourceGuard.of_files(artifact, files)
    fingerprint = hashlib.sha256((artifact / MANIFEST_NAME).read_bytes()).hexdigest()
    digest = plan.digest(fingerprint)
    tx.jobs = len(plan.jobs)
    with tx.held():
        done = tx.finished(digest, overwrite)
        if done is not None:
            return ExportResult(plan, done, already_complete=True)
        return _Run(artifact, tx, plan, guard, digest, fingerprint).execute(overwrite)


@dataclass
class _Run:
    artifact: Path
    tx: Transaction
    plan: ExportPlan
    guard: SourceGuard
    digest: str
    fingerprint: str

    def execute(self, overwrite: bool) -> ExportResult:
        work = self.tx.work
        if not (work.path / MANIFEST_NAME).exists():
            check_target(self.tx.out, work.path, dict.fromkeys(f.name for f in self.plan.files))
            need = space_needed(self.plan.files, work.path, [64 << 10])
            if need > (free := free_bytes(work.path)):
                raise space_error(self.tx.out, need, free, early=True)
            done = self.tx.resume_or_start(self.digest, overwrite, self.guard.ids, self._stale, len(self.plan.jobs))  # fmt: skip
            if done:
                log.info("%d jobs, %d already done (resume)", len(self.plan.jobs), len(done))
            done = work.open_files(self.plan, done)  # type: ignore[arg-type]
            for _ in self.tx.journal(self._run(done)):
                pass
            self._build()
        return ExportResult(self.plan, self.tx.move_in())

    def _stale(self, changed: set[str]) -> set[int]:
        """The jobs that read a layer file of ``changed`` (replaced since: redone)."""
        return {j.id for j in self.plan.jobs if self.plan.layers[j.layer].file in changed}

    def _run(self, done: set[int]) -> Iterator[int]:
        """Write every job not ``done``, yielding its id once its bytes are written."""
        maps: dict[str, MappedFile] = {}
        entries: dict[str, Any] = {}
        writer = PieceWriter(self.plan.files, self.tx.work.path)
        try:
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
                yield job.id
        finally:
            writer.close()

    def _build(self) -> None:
        work = self.tx.work.path
        for f in self.plan.files:
            with open(work / f.name, "rb+") as fh:
                os.fsync(fh.fileno())
        self.guard.check()
        names = [f.name for f in self.plan.files]
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "file_digest": FILE_DIGEST,
            "hetquant_version": hetquant_version(),
            "complete": True,
            "export": self.plan.record(),
            "source": {"path": str(self.artifact), "fingerprint": self.fingerprint},
            "plan_digest": self.digest,
            "parts": {self.plan.exporter.name: {"files": names}},
            "files": digest_files({n: work / n for n in names}),
        }
        write_json_atomic(work / MANIFEST_NAME, manifest)
