"""The native lane: jobs run by the formats' C++ kernels on numpy arrays, without torch.

``import torch`` alone takes 1.5-4.5 s, a third of a 12 GB conversion on 16 cores (issue #16),
and the hot path does not need it: the FP8 → BF16, W8A8 and INT4 row kernels take data pointers,
the writer stores bytes into mapped files, the plan is shapes alone. So :class:`JobRunner`
(``jobs.py``) first offers each job to :class:`NativeJobs`; a job it takes is read from the
source's memory maps as numpy arrays (``SourceCheckpoint.row_arrays``), converted by the
formats' ``*_array`` methods (``formats/arrays.py``) and written as it comes — the same bytes as
the torch code (the kernels are tested bit-identical to it, and the golden artifacts hold).
Recipes whose jobs are all native this way: bf16, ascend-w8a8, ascend-hybrid, awq-w4a16 (RTN).

It takes a job only where every step has a kernel: a copy of BF16/F32 (checked finite by the
absmax kernel) or of a dtype no check applies to; a linear weight from FP8 blocks, BF16 or a
plain float tensor into a format that streams by rows and has ``quantize_array`` (outputs along
the weight's rows written as they come, others assembled, as the torch code does; no per-tensor
amax, no finishing step such as a tiling): bf16, w8a8_dynamic, int4_cpu, awq_w4a16 (RTN);
stacked experts into a format with ``quantize_rows_array``. Anything else — a calibrated job, a
source kept as stored or repacked, another format, no compiler, ``HETQUANT_QUANT_BACKEND=torch``,
bad input a kernel declines (``NotNative``) — goes to the torch code, which imports torch then,
in the process that needs it, and redoes the whole job (fixed byte ranges: a redo is safe).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hetquant.formats.arrays import NotNative, require_finite
from hetquant.formats.dtypes import numpy_dtype
from hetquant.formats.expert_repack import EXPERT_REPACKS
from hetquant.formats.linear_repack import LINEAR_REPACKS

from ..planning.plan import Job, JobKind, OutPiece
from ..planning.source import SourceCheckpoint
from .writer import PieceWriter

__all__ = ["NativeJobs", "needs_torch"]

_CHECKED = frozenset({"BF16", "F32"})  # float copies whose finiteness the absmax kernel checks
_UNCHECKED = frozenset({"F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"})


@dataclasses.dataclass
class NativeJobs:
    """Runs the jobs the kernels can take (module docstring), writing through ``out``."""

    source: SourceCheckpoint
    out: PieceWriter

    def __post_init__(self) -> None:
        self._handlers = {
            JobKind.COPY: self._copy,
            JobKind.LINEAR: self._linear,
            JobKind.EXPERTS: self._experts,
        }

    def run(self, job: Job) -> bool:
        """Run ``job`` natively; False (nothing promised about its bytes) where it cannot."""
        try:
            self._handlers[job.kind](job)
        except NotNative:
            return False
        return True

    def declines(self, job: Job) -> bool:
        """Whether ``job`` goes to the torch code whatever its data says (its formats alone)."""
        try:
            if job.kind is JobKind.LINEAR:
                self._linear_plan(job)
            elif job.kind is JobKind.EXPERTS:
                self._experts_format(job)
        except NotNative:
            return True
        return False

    def _copy(self, job: Job) -> None:
        dtype, data = self.source.weight_array(job.source)
        if dtype in _CHECKED:
            require_finite(job.source, data)
        elif dtype not in _UNCHECKED:
            raise NotNative(f"{job.source}: no finite check for {dtype}")
        self._write(job.outputs[0], data)

    def _linear_plan(self, job: Job) -> tuple[Any, Any]:
        """(streaming plan, its ``quantize_array``) of a linear job; NotNative where none."""
        fmt = job.target.fmt
        src = self.source.tensors[job.source]
        if src.fmt == fmt or (src.fmt_name, fmt.name) in LINEAR_REPACKS:
            raise NotNative("kept as stored, or repacked")
        plan = fmt.streaming(src.shape)  # type: ignore[arg-type]
        native = plan is not None and plan.chunk_format.native_quantize
        quantize = plan.chunk_format.quantize_array if native else None
        if quantize is None or plan.finish is not None or plan.place is not None or plan.needs_amax:  # type: ignore[union-attr]
            raise NotNative(f"{fmt.name}: no native streaming")
        return plan, quantize

    def _linear(self, job: Job) -> None:
        plan, quantize = self._linear_plan(job)
        shape = self.source.tensors[job.source].shape
        pieces = {p.key: p for p in job.outputs}
        metas = plan.chunk_format.stored(shape)  # type: ignore[union-attr, arg-type]
        buffers = {k: np.empty(m.shape, numpy_dtype(m.dtype))  # assembled, written at the end
                   for k, m in metas.items() if plan.axes[k] != 0}  # type: ignore[union-attr]  # fmt: skip
        for row0, rows in self.source.row_arrays(job.source):
            for key, part in quantize(rows).items():
                axis = plan.axes[key]  # type: ignore[union-attr]
                if axis == 0:  # written as it comes
                    piece = pieces[key]
                    self._write(piece, part, row0 * (piece.meta.nbytes // piece.meta.shape[0]))
                elif axis is None:  # a value of the whole weight
                    buffers[key] = part
                else:  # these rows' entries along ``axis``: len / out per row
                    start = row0 * buffers[key].shape[axis] // shape[0]
                    index = [slice(None)] * part.ndim
                    index[axis] = slice(start, start + part.shape[axis])
                    buffers[key][tuple(index)] = part
        for key, data in buffers.items():
            self._write(pieces[key], data)

    def _experts_format(self, job: Job) -> Any:
        """The expert format's ``quantize_rows_array``; NotNative where it has none."""
        fmt = job.target.fmt
        source_fmt = self.source.tensors[job.source].fmt_name
        if not fmt.native_rows or (source_fmt, job.target.name) in EXPERT_REPACKS:
            raise NotNative(f"{job.target.name}: no native rows")
        return fmt.quantize_rows_array

    def _experts(self, job: Job) -> None:
        quantize = self._experts_format(job)
        gate, up, down = job.sources
        shapes = [self.source.tensors[n].shape for n in job.sources]
        if shapes[0] != shapes[1] or shapes[2] != shapes[0][::-1]:
            raise NotNative("expert shapes disagree")  # the torch code names them
        pieces = {p.key: p for p in job.outputs}
        rows = self.source.row_arrays
        for (r, g), (_, u) in zip(rows(gate), rows(up), strict=True):
            packed, scale = quantize(g, u)  # gate and up rows interleaved
            self._write(pieces["gate_up_packed"], packed, 2 * r * packed.shape[1])
            self._write(pieces["gate_up_scale"], scale, 2 * r * scale.itemsize)
        for r, d in rows(down):
            packed, scale = quantize(d)
            self._write(pieces["down_packed"], packed, r * packed.shape[1])
            self._write(pieces["down_scale"], scale, r * scale.itemsize)

    def _write(self, piece: OutPiece, data: Any, rel: int = 0) -> None:
        self.out.write(piece.tensor, piece.offset + rel, data)


def needs_torch(source: SourceCheckpoint, jobs: list[Job], calibrated: Any = ()) -> bool:
    """Whether some of ``jobs`` will run the torch code, from their formats alone (no bytes
    read; a job the lane takes may still hand bad input to torch, which that worker imports
    then). ``calibrated``: the source names a calibration changes (always torch). The pool's
    parent imports torch once before it forks where this holds, rather than every worker on its
    own (seconds of CPU and 100-300 MB of private memory each)."""
    from hetquant.formats._quant_native import available

    lane = NativeJobs(source, None)  # type: ignore[arg-type]  # declines() writes nothing
    return not available() or any(
        any(name in calibrated for name in job.sources) or lane.declines(job) for job in jobs
    )
