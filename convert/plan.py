"""Plan: from shapes and dtypes alone, every output file, tensor, byte offset and job.

``make_plan`` never touches tensor data: it takes shape-only :class:`SourceItem` s (from a source's
headers, or replayed from a manifest), asks the recipe where each goes and the format what it
stores, and lays the root part out in shards of at most ``max_shard_size`` bytes (a tensor larger
than that gets a shard of its own, as ``transformers`` does). Each job converts one source tensor
and owns the byte ranges of its outputs, so jobs can run in any order, in any process, and be
redone after a crash with identical results.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hetquant.formats import TensorMeta, get_format
from hetquant.formats.safetensors_io import build_header

from .deepseek_v3 import TensorRole
from .recipes import COPY, ROOT, Recipe, Target

__all__ = ["Job", "OutFile", "OutTensor", "Plan", "SourceItem", "make_plan", "parse_size"]

WEIGHT_SUFFIX = ".weight"
HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class SourceItem:
    """Shape-only view of one source tensor."""

    name: str
    role: TensorRole
    dtype: str
    has_scale: bool


@dataclass(frozen=True)
class OutTensor:
    name: str
    meta: TensorMeta


@dataclass(frozen=True)
class Job:
    """Convert source tensor ``source`` into ``outputs`` with format ``target.fmt``."""

    id: int
    source: str
    target: Target
    outputs: tuple[OutTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(o.meta.nbytes for o in self.outputs)


@dataclass
class OutFile:
    """One output safetensors file: its tensors in data order, header bytes and offsets."""

    name: str  # path relative to OUTPUT
    part: str
    tensors: list[OutTensor] = field(default_factory=list)

    @property
    def header(self) -> bytes:
        return build_header(((t.name, t.meta) for t in self.tensors), HEADER_METADATA)

    @property
    def data_size(self) -> int:
        return sum(t.meta.nbytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size

    def offsets(self) -> dict[str, int]:
        """Absolute file offset of every tensor's first byte."""
        pos, out = len(self.header), {}
        for t in self.tensors:
            out[t.name] = pos
            pos += t.meta.nbytes
        return out


@dataclass
class Plan:
    recipe: Recipe
    items: list[SourceItem]
    jobs: list[Job]
    files: list[OutFile]
    max_shard_size: int

    def file_of(self) -> dict[str, OutFile]:
        """Output tensor name → the file holding it."""
        return {t.name: f for f in self.files for t in f.tensors}

    def digest(self, fingerprint: str) -> str:
        """Identity of this plan for resume: same source, recipe, options and layout."""
        doc = {
            "fingerprint": fingerprint,
            "recipe": self.recipe.name,
            "options": self.recipe.options,
            "files": [[f.name, hashlib.sha256(f.header).hexdigest()] for f in self.files],
            "jobs": [[j.source, j.target.fmt, j.target.params] for j in self.jobs],
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def parse_size(text: str | int) -> int:
    """'5GB' → 5_000_000_000 (decimal units, like transformers; 'GiB' is binary)."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    try:
        value = float(num) * units[s[len(num) :].strip()]
    except (KeyError, ValueError):
        from hetquant.formats import HetquantError

        raise HetquantError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB or 2GiB") from None
    return int(value)


def make_plan(items: Iterable[SourceItem], recipe: Recipe, max_shard_size: int) -> Plan:
    """Lay out every output of converting ``items`` with ``recipe`` (shape-only)."""
    items = list(items)
    jobs = [_job(i, item, recipe.assign(item.role, item.dtype)) for i, item in enumerate(items)]
    files = _layout(jobs, max_shard_size)
    return Plan(recipe, items, jobs, files, max_shard_size)


def _job(idx: int, item: SourceItem, target: Target) -> Job:
    if target.fmt == COPY:
        outputs = (OutTensor(item.name, TensorMeta(item.dtype, item.role.shape)),)
    else:
        fmt = get_format(target.fmt, **dict(target.params))
        prefix = item.name.removesuffix(WEIGHT_SUFFIX)
        stored = fmt.stored(item.role.shape)  # type: ignore[arg-type]
        outputs = tuple(OutTensor(f"{prefix}.{k}", m) for k, m in stored.items())
    return Job(idx, item.name, target, outputs)


def _layout(jobs: list[Job], max_shard_size: int) -> list[OutFile]:
    root: list[list[Job]] = [[]]
    size = 0
    named: dict[str, OutFile] = {}
    for job in jobs:
        if job.target.part != ROOT:
            if job.target.file is None:
                raise ValueError(
                    f"recipe sent {job.source} to part {job.target.part} without a file"
                )
            f = named.setdefault(job.target.file, OutFile(job.target.file, job.target.part))
            f.tensors.extend(job.outputs)
            continue
        if root[-1] and size + job.nbytes > max_shard_size:
            root.append([])
            size = 0
        root[-1].append(job)
        size += job.nbytes
    n = len(root)
    files = [
        OutFile(
            f"model-{i + 1:05d}-of-{n:05d}.safetensors", ROOT, [o for j in js for o in j.outputs]
        )
        for i, js in enumerate(root)
    ]
    return files + [named[k] for k in sorted(named)]


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {
        "files": len(plan.files),
        "bytes": sum(f.size for f in plan.files),
        "jobs": len(plan.jobs),
    }
