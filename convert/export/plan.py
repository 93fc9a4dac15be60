"""The plan of ``hetquant export``: every file, tensor and job, shape-only (no I/O).

The artifact's manifest and layer headers give each MoE layer's format and dims
(:class:`~hetquant.convert.export.exporters.ExpertLayer`); the exporter checks them (bad input:
one ``HetquantError`` naming the layer, before anything is written) and names every output
tensor; the outputs become containers (``planning/containers.py``: ``raw`` for kt's ``.kt``
files, ``safetensors``), one job per (layer, expert) owning its byte ranges. ``hetquant verify``
replays it from the manifest's ``export`` entry (:func:`replay_export`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hetquant.formats import HetquantError

from ..planning.containers import Container, OutTensor, make_container
from ..planning.plan import OutPiece
from .exporters import ExpertLayer, Exporter, get_exporter

__all__ = ["ExportJob", "ExportPlan", "plan_export", "replay_export"]


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
