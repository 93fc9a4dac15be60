"""Plan: from shapes and dtypes alone, every output file, tensor, byte offset and job.

``make_plan`` never touches tensor data: it takes shape-only :class:`SourceItem` s (from a source's
headers, or replayed from a manifest), asks the recipe where each goes and the format what it
stores, and lays the root part out in shards of at most ``max_shard_size`` bytes (a tensor larger
than that gets a shard of its own, as ``transformers`` does). Routed experts sent to an
expert-layer format are stacked: one file per layer (in the target's container, see
``containers``), one job per expert writing its slice of every stacked tensor. Each job owns the
byte ranges of its outputs (``OutPiece``), so jobs run in any order, in any process, and can be
redone after a crash with identical results.

Fused GEMMs share a per-tensor scale: where a format derives one from the weight's absmax
(``Streaming.needs_amax``: NVFP4's ``weight_scale_2``), the linears that engines merge into one
module (``Role.fused``: a gated MLP's gate and up, per layer and routed expert; DeepSeek's
``q_a`` + ``kv_a``) and that go to the same format take their joint absmax (``Job.amax_group``),
as ModelOpt's export does (``modelopt/torch/export/quant_utils.py:1490-1562``
``preprocess_linear_fusion``; groups by shared input, ``unified_export_hf.py:376-408``, and by
expert index, ``:520-540``), because vLLM keeps one value per merged module
(``vllm/model_executor/layers/quantization/modelopt.py``: the max for linears, w1's for MoE;
reference/fp4.md §8).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hetquant.formats import HetquantError, TensorMeta
from hetquant.formats._gc import paused_gc
from hetquant.formats.families import TensorRole
from hetquant.formats.families.vlm import check_vision_kept

from ..recipes import ROOT, Action, Recipe, Target
from .containers import SAFETENSORS, Container, OutTensor, SafetensorsFile, make_container

__all__ = [
    "Job",
    "OutPiece",
    "OutTensor",
    "Plan",
    "SourceItem",
    "make_plan",
    "parse_size",
    "plan_for",
]

WEIGHT_SUFFIX = ".weight"
EXPERT_PARTS = ("gate", "up", "down")  # a routed expert's gated MLP, as quantize_expert takes it


@dataclass(frozen=True)
class SourceItem:
    """Shape-only view of one source tensor: its role, dtype (of the tensor carrying the role's
    name) and source format (a registered format's name, or ``plain``)."""

    name: str
    role: TensorRole
    dtype: str
    fmt: str
    params: tuple[tuple[str, Any], ...] = ()  # the source format variant's (group size, ...)


@dataclass(frozen=True)
class OutPiece:
    """Bytes a job writes: ``meta``-shaped data at byte ``offset`` of output tensor ``tensor``."""

    tensor: str
    key: str  # key of the piece in the dict the job's conversion returns
    offset: int
    meta: TensorMeta


class JobKind(str, Enum):
    """How a job turns its sources into outputs (a str: the plan digest records the value)."""

    COPY = "copy"  # the source bytes as they are
    LINEAR = "linear"  # one weight into its target format
    EXPERTS = "experts"  # one expert's gate/up/down into its slice of an expert-layer format


@dataclass(frozen=True)
class Job:
    """Convert ``sources`` with ``target`` into ``outputs``."""

    id: int
    kind: JobKind
    sources: tuple[str, ...]
    target: Target
    outputs: tuple[OutPiece, ...]
    # source weights whose joint absmax sets the per-tensor scale (itself included); () alone
    amax_group: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        return self.sources[0]

    @property
    def nbytes(self) -> int:
        return sum(o.meta.nbytes for o in self.outputs)


@dataclass
class Plan:
    recipe: Recipe
    items: list[SourceItem]
    jobs: list[Job]
    files: list[Container]
    max_shard_size: int

    def file_of(self) -> dict[str, Container]:
        """Output tensor name → the file holding it."""
        return {t.name: f for f in self.files for t in f.tensors}

    def item(self, name: str) -> SourceItem:
        """The source item called ``name``."""
        index = self.__dict__.get("_index")
        if index is None:
            index = self.__dict__["_index"] = {i.name: i for i in self.items}
        return index[name]

    def digest(self, fingerprint: str) -> str:
        """Identity of this plan for resume: same source, recipe, options and layout."""
        doc = {
            "fingerprint": fingerprint,
            "recipe": self.recipe.name,
            "options": self.recipe.options,
            "files": [[f.name, f.layout_digest()] for f in self.files],
            "jobs": [
                [
                    j.kind,
                    j.sources,
                    j.target.name,
                    j.target.params,
                    *([j.amax_group] * bool(j.amax_group)),
                ]
                for j in self.jobs
            ],
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
        raise HetquantError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB or 2GiB") from None
    if not 1 <= value < float("inf"):  # also nan, inf and sizes that int() would make 0
        raise HetquantError(f"size {text!r} must be at least 1 byte and finite, e.g. 5GB")
    return int(value)


def plan_for(source: Any, recipe: Recipe, max_shard_size: int) -> Plan:
    """The plan of converting ``source`` (a ``SourceCheckpoint``: its headers only)."""
    items = [
        SourceItem(t.name, t.role, t.dtype, t.fmt_name, t.fmt_params)
        for t in source.tensors.values()
    ]
    return make_plan(items, recipe, max_shard_size)


@paused_gc()  # a job per tensor, a piece per stored one: no cycles (formats/_gc.py)
def make_plan(items: Iterable[SourceItem], recipe: Recipe, max_shard_size: int) -> Plan:
    """Lay out every output of converting ``items`` with ``recipe`` (shape-only)."""
    items = list(items)
    recipe.check_model([i.role for i in items])
    jobs: list[Job] = []
    stacked: dict[str, Container] = {}
    experts: dict[tuple[str, int, int], dict[str, SourceItem]] = {}
    assigned = [(i, _as_stored(i, _target(recipe, i))) for i in items]
    check_vision_kept(((i.name, i.role, t.name) for i, t in assigned), recipe.name)
    groups = _amax_groups(assigned)
    for item, target in assigned:
        if target.action is Action.DROP:
            continue
        if target.stacks_experts:
            key = (target.file or "", item.role.layer or 0, item.role.expert or 0)
            experts.setdefault(key, {})[item.role.role.mlp or item.role.role.name] = item
            continue
        jobs.append(_job(len(jobs), item, target, groups.get(item.name, ())))
    n_experts: dict[tuple[str, int], int] = {}
    for file, layer, e in experts:
        n_experts[file, layer] = max(n_experts.get((file, layer), 0), e + 1)
    for (file, layer, e), members in experts.items():
        n = n_experts[file, layer]
        jobs.append(_expert_job(len(jobs), file, layer, e, n, members, recipe, stacked))
    files = _shard_root(jobs, max_shard_size) + [stacked[k] for k in sorted(stacked)]
    return Plan(recipe, items, jobs, files, max_shard_size)


def _target(recipe: Recipe, item: SourceItem) -> Target:
    """What ``recipe`` makes of ``item``; an error names the tensor."""
    target = recipe.assign(item.role, item.fmt)
    try:
        return recipe.refine(target, item.params, item.fmt)
    except HetquantError as e:
        raise HetquantError(f"{item.name}: {e}") from None


def _as_stored(item: SourceItem, target: Target) -> Target:
    """A target in the source's own format whose parameters agree with the source variant's
    takes that variant whole (Kimi K2 Thinking's experts: compressed-tensors group 32 with an
    I32 ``weight_shape``): the converter then keeps the stored tensors as they are, no rounding
    (``JobRunner``)."""
    if target.name != item.fmt or not item.params:
        return target
    source = dict(item.params)
    same = {**source, **dict(target.params)} == source
    return target.with_params(item.params) if same else target


def _amax_groups(assigned: list[tuple[SourceItem, Target]]) -> dict[str, tuple[str, ...]]:
    """Source name → the members of its merged module (``Role.fused``, same layer and routed
    expert, same target) whose joint absmax sets the format's per-tensor scale; only groups of
    two or more, only formats that derive that scale from the absmax (module docstring)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for item, target in assigned:
        label = item.role.role.fused
        if label is None or target.action is not Action.CONVERT or target.stacks_experts:
            continue
        streaming = target.fmt.streaming(item.role.shape)  # type: ignore[union-attr,arg-type]
        if streaming is not None and streaming.needs_amax:
            key = (item.role.layer, item.role.expert, label, target)
            groups.setdefault(key, []).append(item.name)
    return {name: tuple(g) for g in groups.values() if len(g) > 1 for name in g}


def _job(idx: int, item: SourceItem, target: Target, amax_group: tuple[str, ...] = ()) -> Job:
    if target.action is Action.COPY:
        meta = TensorMeta(item.dtype, item.role.shape)
        return Job(
            idx, JobKind.COPY, (item.name,), target, (OutPiece(item.name, item.name, 0, meta),)
        )
    fmt = target.fmt
    prefix = item.name.removesuffix(WEIGHT_SUFFIX)
    try:
        stored = fmt.stored(item.role.shape)  # type: ignore[arg-type]
    except HetquantError as e:  # a shape the format cannot store: name the tensor
        raise HetquantError(f"{item.name} {list(item.role.shape)}: {e}") from None
    outputs = tuple(OutPiece(f"{prefix}.{k}", k, 0, m) for k, m in stored.items())
    return Job(idx, JobKind.LINEAR, (item.name,), target, outputs, amax_group)


def _expert_job(
    idx: int, file: str, layer: int, e: int, n_experts: int, members: dict[str, SourceItem], recipe: Recipe,
    stacked: dict[str, Container],
) -> Job:  # fmt: skip
    missing = [r for r in EXPERT_PARTS if r not in members]
    if missing or not file:
        raise HetquantError(
            f"layer {layer} expert {e}: recipe {recipe.name} stacks {sorted(members)} but not {missing}"
        )
    gate, down = members["gate"], members["down"]
    target = _target(recipe, gate)
    if target.part == ROOT:
        raise HetquantError(
            f"recipe {recipe.name}: stacked experts must go to a part of their own, not the root"
        )
    inter, hidden = gate.role.shape
    layer_metas = target.fmt.stored(n_experts, hidden, inter)  # type: ignore[union-attr,call-arg]
    prefix = down.role.stack
    if prefix is None:
        raise HetquantError(f"{down.name}: not a routed expert; only routed experts are stacked")
    out = stacked.get(file)
    if out is None:
        out = stacked[file] = make_container(target.container, file, target.part)
    if not any(t.name.startswith(prefix + ".") for t in out.tensors):
        out.tensors.extend(OutTensor(f"{prefix}.{k}", m) for k, m in layer_metas.items())
    pieces = []
    for k, m in layer_metas.items():
        per = TensorMeta(m.dtype, m.shape[1:])
        pieces.append(OutPiece(f"{prefix}.{k}", k, e * per.nbytes, per))
    sources = tuple(members[r].name for r in EXPERT_PARTS)
    return Job(idx, JobKind.EXPERTS, sources, target, tuple(pieces))


def _shard_root(jobs: list[Job], max_shard_size: int) -> list[Container]:
    groups: list[list[Job]] = [[]]
    size = 0
    for job in jobs:
        if job.target.part != ROOT:
            if job.kind is not JobKind.EXPERTS:
                raise HetquantError(
                    f"recipe sent {job.source} to part {job.target.part}, which only takes stacked experts"
                )
            continue
        if job.target.container != SAFETENSORS:
            raise HetquantError(
                f"recipe sent {job.source} to the root part in a {job.target.container} container; "
                "the root part is an HF model directory of safetensors shards"
            )
        if groups[-1] and size + job.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(job)
        size += job.nbytes
    n = len(groups)
    return [
        SafetensorsFile(
            f"model-{i + 1:05d}-of-{n:05d}.safetensors",
            ROOT,
            [OutTensor(o.tensor, o.meta) for j in js for o in j.outputs],
        )
        for i, js in enumerate(groups)
    ]
