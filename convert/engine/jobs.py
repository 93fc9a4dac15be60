"""Executing one job: read a source tensor, convert it, write its outputs at their offsets.

Jobs are independent and idempotent (fixed offsets, deterministic bytes). Source weights come a
block of rows at a time, validated and dequantized exactly by their own format
(``SourceCheckpoint.rows``). A format whose stored tensors run along the weight's rows
(``WeightFormat.streaming``) is converted one such block at a time: rows-major outputs are written
as they come, others are assembled at their packed size, so memory stays near one block row plus
the (4- or 8-bit) output however large the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats._lazy import torch
from hetquant.formats.base import check_finite
from hetquant.formats.dtypes import st_dtype, torch_dtype
from hetquant.formats.expert_repack import EXPERT_REPACKS
from hetquant.formats.linear_repack import LINEAR_REPACKS

from ..planning.plan import Job, JobKind, OutPiece, Plan
from ..planning.source import SourceCheckpoint
from .native_jobs import NativeJobs
from .tree_hashing import Nodes, hashed_in_worker, tree_digests
from .writer import PieceWriter

__all__ = ["JobRunner", "job_peak_bytes"]

STREAM_ROWS = 128  # rows of one streamed source block (an FP8 block row), for the estimate


@dataclass
class JobRunner:
    """Runs jobs of ``plan`` against ``source``, writing into the files under ``work_dir``."""

    source: SourceCheckpoint
    plan: Plan
    work_dir: Path
    calibration: Any = None  # calib.CalibrationResult: AWQ transforms applied before quantizing
    shared: bool = False  # other processes write the same files (``writer``: mapped stores)

    def __post_init__(self) -> None:
        hash_nodes = self.shared and tree_digests()  # a pool worker hashes what it stores
        self._out = PieceWriter(self.plan.files, self.work_dir, self.shared, hash_nodes)
        self._handlers = {
            JobKind.COPY: self._copy,
            JobKind.LINEAR: self._linear,
            JobKind.EXPERTS: self._experts,
        }
        self._native = NativeJobs(self.source, self._out)
        self._threads: int | None = None  # torch's threads before this runner's first torch job
        self._amax: dict[str, float] = {}  # the last few weights' absmax (a merged group's)

    def run(self, job: Job) -> int:
        """Run one job, natively where the kernels can (``native_jobs``), else with the torch
        code (one torch thread: jobs are block rows, the pool is the parallelism; restored at
        :meth:`close`); returns the source bytes it consumed."""
        self._out.take_nodes()  # a failed job's, if any
        try:
            if any(map(self._calibrated, job.sources)) or not self._native.run(job):
                if self._threads is None:
                    self._threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                self._handlers[job.kind](job)
        except HetquantError as e:  # a format's message may not name the tensor
            if any(name.rpartition(".")[0] in str(e) for name in job.sources):
                raise
            raise HetquantError(f"{job.source}: {e}") from None
        return sum(self.source.tensors[name].nbytes for name in job.sources)

    def tree_nodes(self, job: Job) -> list[Nodes] | None:
        """The BLAKE3 tree nodes of the ranges ``job`` wrote, hashed here as they were stored
        through the output's maps (``tree_hashing.hashed_in_worker``); None where they were not."""
        return hashed_in_worker(self._out, job)

    def close(self) -> None:
        self._out.close()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def _copy(self, job: Job) -> None:
        data = self.source.weight(job.source)
        check_finite(job.source, data)
        if self._calibrated(job.source):  # a norm or router the AWQ fold changed
            data = self.calibration.apply(job.source, data.to(torch.float32)).to(data.dtype)
        self._write(job.outputs[0], data)

    def _calibrated(self, name: str) -> bool:
        return self.calibration is not None and name in self.calibration

    def _rows(self, name: str):
        """(first row, rows) of source weight ``name``, block by block, calibrated if it is."""
        for row0, rows in self.source.rows(name):
            if self._calibrated(name):
                rows = self.calibration.apply(name, rows, row0)
            yield row0, rows

    def _linear(self, job: Job) -> None:
        fmt = job.target.fmt
        src = self.source.tensors[job.source]
        if src.fmt == fmt and not self._calibrated(job.source):
            self._as_stored(job)
            return
        repack = LINEAR_REPACKS.get((src.fmt_name, fmt.name))
        if repack and repack.holds(src.fmt, fmt) is None and not self._calibrated(job.source):
            stored = self.source.stored(job.source)
            others = [self.source.stored(n) for n in job.amax_group if n != job.source]
            why = repack.fits(stored, fmt, others) if repack.fits else None  # on the data
            if why is None:
                self._write_repacked(job, repack.repack(stored, fmt, others))  # shared values
                return
            if not self.plan.recipe.options.get("requantize"):
                raise HetquantError(f"{job.source}: {why}")
        shape = src.shape
        plan = fmt.streaming(shape)  # type: ignore[arg-type]
        if plan is None:
            stored = fmt.quantize(self._whole(job.source))
            for piece in job.outputs:
                self._write(piece, stored[piece.key])
            return
        pieces = {p.key: p for p in job.outputs}
        whole = plan.finish is None and plan.place is None  # else every key is assembled
        direct = {k for k, ax in plan.axes.items() if ax == 0 and whole}
        chunk_metas = plan.chunk_format.stored(shape)  # type: ignore[arg-type]  # before finish
        buffers = {
            k: torch.empty(m.shape, dtype=torch_dtype(m.dtype))
            for k, m in chunk_metas.items()
            if k not in direct
        }
        opts = {"weight_amax": self._absmax(job)} if plan.needs_amax else {}
        for row0, rows in self._rows(job.source):
            stored = plan.chunk_format.quantize(rows, **opts)
            for key, part in stored.items():
                axis = plan.axes[key]
                if key in direct:
                    piece = pieces[key]
                    self._write(piece, part, row0 * (piece.meta.nbytes // piece.meta.shape[0]))
                elif axis is None:
                    buffers[key] = part
                else:
                    start = (
                        row0 * buffers[key].shape[axis] // shape[0]
                    )  # entries per row: len / out
                    if plan.place is None or not plan.place(key, buffers[key], part, start):
                        buffers[key].narrow(axis, start, part.shape[axis]).copy_(part)
        final = plan.finish(buffers) if plan.finish else buffers
        for key, piece in pieces.items():
            if key not in direct:
                self._write(piece, final[key])

    def _as_stored(self, job: Job) -> None:
        """A source module already in the target variant: its stored tensors, validated (the
        format's own source checks: NaN/Inf scales, bad shapes), written as they are."""
        for _ in self.source.rows(job.source):
            pass
        stored = self.source.stored(job.source)
        for piece in job.outputs:
            self._write(piece, stored[piece.key])

    def _absmax(self, job: Job) -> float:
        """``max |W|`` over the job's weight and the others of its merged module
        (``Job.amax_group``), so that they share one per-tensor scale. Kept for the next few
        jobs: a group's members (an expert's gate and up) need the same ones."""
        for name in job.amax_group or job.sources:
            if name not in self._amax:
                if len(self._amax) >= 8:
                    del self._amax[next(iter(self._amax))]
                self._amax[name] = self.source.absmax(name)
        return max(self._amax[name] for name in job.amax_group or job.sources)

    def _experts(self, job: Job) -> None:
        fmt = job.target.fmt
        source_fmt = self.source.tensors[job.source].fmt_name
        repack = EXPERT_REPACKS.get((source_fmt, job.target.name))
        if repack is not None:
            self._repack(job, repack)
            return
        if fmt.streams_rows:
            self._experts_streaming(job, fmt.quantize_rows)
            return
        gate, up, down = (self._whole(name) for name in job.sources)
        stored = fmt.quantize_expert(gate, up, down)
        for piece in job.outputs:
            self._write(piece, stored[piece.key])

    def _repack(self, job: Job, repack: Any) -> None:
        """Source codes and scales carried over as they are (``formats/expert_repack.py``)."""
        self._write_repacked(job, repack(*(self.source.stored(name) for name in job.sources)))

    def _write_repacked(self, job: Job, stored: dict[str, torch.Tensor]) -> None:
        """Write repacked tensors, each checked against the plan's dtype and shape."""
        for piece in job.outputs:
            got = stored[piece.key]
            if st_dtype(got.dtype) != piece.meta.dtype or tuple(got.shape) != piece.meta.shape:
                raise HetquantError(
                    f"{job.source}: repacked {piece.key} is {st_dtype(got.dtype)}"
                    f"{list(got.shape)}, the plan expects {piece.meta.dtype}"
                    f"{list(piece.meta.shape)} ({job.target.name} {dict(job.target.params)}); the "
                    "source's group size differs from the plan's"
                )
            self._write(piece, got)

    def _whole(self, name: str) -> torch.Tensor:
        """Source weight ``name`` dequantized, calibrated if it is."""
        w = self.source.dequantized(name)
        return self.calibration.apply(name, w) if self._calibrated(name) else w

    def _experts_streaming(self, job: Job, quantize_rows: Any) -> None:
        """Per-row expert formats one block row at a time, gate and up rows interleaved."""
        gate, up, down = job.sources
        shapes = [self.source.tensors[n].shape for n in job.sources]
        if shapes[0] != shapes[1] or shapes[2] != shapes[0][::-1]:
            raise HetquantError(f"{down}: expert shapes {shapes}, expected [I, H], [I, H], [H, I]")
        pieces = {p.key: p for p in job.outputs}
        for (r, g), (_, u) in zip(self._rows(gate), self._rows(up), strict=True):
            gu = torch.stack([g, u], dim=1).reshape(2 * g.shape[0], g.shape[1])  # interleaved
            packed, scale = quantize_rows(gu)
            self._write(pieces["gate_up_packed"], packed, 2 * r * packed.shape[1])
            self._write(pieces["gate_up_scale"], scale, 2 * r * _row_bytes(scale))
        for r, d in self._rows(down):
            packed, scale = quantize_rows(d)
            self._write(pieces["down_packed"], packed, r * packed.shape[1])
            self._write(pieces["down_scale"], scale, r * _row_bytes(scale))

    def _write(self, piece: OutPiece, data: torch.Tensor, rel: int = 0) -> None:
        """Write ``data`` into ``piece`` at ``rel`` bytes past the piece's start."""
        self._out.write(piece.tensor, piece.offset + rel, data)


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes per row (dim 0) of ``t``: a per-row scale [R] or a group-wise one [R, K/g]."""
    return t.nbytes // t.shape[0]


def job_peak_bytes(job: Job, source: SourceCheckpoint) -> int:
    """Estimated transient memory of one job: streamed block rows plus assembled outputs, or
    whole weights for formats that cannot stream."""
    if job.kind is JobKind.COPY:
        return 0
    total = 0
    for name in job.sources:
        rows, cols = source.tensors[name].shape
        if _streams(job, (rows, cols)):
            rows = min(rows, STREAM_ROWS)
        total += rows * cols * (2 + 4 + 4)  # bf16 weight, f32 working copy, f32 temporaries
    return total + job.nbytes


def _streams(job: Job, shape: tuple[int, int]) -> bool:
    fmt = job.target.fmt
    if job.kind is JobKind.EXPERTS:  # stream their rows, calibrated or not
        return fmt.streams_rows
    return fmt.streaming(shape) is not None
