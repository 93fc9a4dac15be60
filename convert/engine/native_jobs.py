"""The native lane: jobs run by the formats' C++ kernels on numpy arrays, without torch.

``import torch`` alone takes 1.5-4.5 s, a third of a 12 GB conversion on 16 cores (issue #16),
and the hot path does not need it: the FP8 → BF16, W8A8 and INT4 row kernels take data pointers,
the writer stores bytes into mapped files, the plan is shapes alone. So :class:`JobRunner`
(``jobs.py``) first offers each job to :class:`NativeJobs`; a job it takes is read from the
source's memory maps as numpy arrays (``SourceCheckpoint.row_arrays``), converted by the
formats' ``*_array`` methods (``formats/arrays.py``) and written as it comes — the same bytes as
the torch code (the kernels are tested bit-identical to it, and the golden artifacts hold).
Recipes whose jobs are all native this way: bf16, ascend-w8a8, ascend-hybrid, awq-w4a16 (RTN),
fp4 (both layouts).

It takes a job only where every step has a kernel: a copy of BF16/F32 (checked finite by the
absmax kernel) or of a dtype no check applies to; a linear weight from FP8 blocks, BF16 or a
plain float tensor into a format that streams by rows and has ``quantize_array`` (outputs along
the weight's rows written as they come, others assembled, as the torch code does; no finishing
step): bf16, w8a8_dynamic, int4_cpu, nvfp4; into a chunk format with ``quantize_array_into``
(``native_into``), which writes each chunk straight into the assembled tensors, in the stored
layout (nvfp4_ascend's tile order, which its plan's ``Streaming.place`` also does) or as the
column block it is (awq_w4a16 RTN: stored transposed, so no strided copy follows). A plan
that ``needs_amax`` gets it by the kernels (``SourceCheckpoint.absmax_array``: for FP8 blocks a
column max of the codes per block row), each weight's once per process (a gate/up pair shares
it). Stacked experts go into a format with ``quantize_rows_array``.

Where the writer maps the output (a pool worker's, on tmpfs: ``writer.py``), the rows that are
written as they come are computed in its pages (``PieceWriter.destination``), so their write
copies nothing: FP8 dequantized into a BF16 target (``_in_place``), a format's rows quantized
there (``quantizes_rows_into``: W8A8's int8 codes, ``_lent``; ``native_rows_into``: the INT4
experts' packed rows, ``_packed_rows``). A worker that hashes what it stores (BLAKE3 tree
digests) still hashes each block row right after, while in the cache. On the 16-core host, 16
processes copy at 5× one process's rate while the kernels scale 11-17× (benchmarks/notes/
convert-scaling.md, tenth round). Tensors assembled whole (AWQ's, NVFP4's) stay private until
their one write: computed in the mapped output they were hashed cold at the job's end, and
measured slower (same notes).

Anything else — a calibrated job, a source kept as stored or repacked, another format, no
compiler, ``HETQUANT_QUANT_BACKEND=torch``, bad input a kernel declines (``NotNative``; a kernel
lent the output's pages may have written part of them) — goes to the torch code, which imports
torch then, in the process that needs it, and redoes the whole job (fixed byte ranges: a redo
is safe).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hetquant.formats.arrays import NotNative, RowsInto, require_finite
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
        self._amax: dict[str, float] = {}  # source weight → its absmax (``_absmax``)

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

    def _linear_plan(self, job: Job) -> Any:
        """The streaming plan of a linear job whose chunk format has the kernels it needs
        (``quantize_array_into`` where the plan places chunks, else ``quantize_array``);
        NotNative where it has not."""
        fmt = job.target.fmt
        src = self.source.tensors[job.source]
        if src.fmt == fmt or (src.fmt_name, fmt.name) in LINEAR_REPACKS:
            raise NotNative("kept as stored, or repacked")
        plan = fmt.streaming(src.shape)  # type: ignore[arg-type]
        chunk = None if plan is None or plan.finish is not None else plan.chunk_format
        if chunk is None or not (chunk.native_into or chunk.native_quantize):
            raise NotNative(f"{fmt.name}: no native streaming")
        return plan

    def _linear(self, job: Job) -> None:
        plan = self._linear_plan(job)
        shape = self.source.tensors[job.source].shape
        pieces = {p.key: p for p in job.outputs}
        opts = {"weight_amax": self._absmax(job)} if plan.needs_amax else {}
        metas = plan.chunk_format.stored(shape)
        into = plan.chunk_format.native_into  # chunks straight into the assembled tensors
        assembled = {k for k in metas if plan.axes[k] != 0 or into}
        buffers = {k: np.empty(metas[k].shape, numpy_dtype(metas[k].dtype)) for k in assembled}
        for row0, rows in self.source.row_arrays(job.source, self._in_place(plan, pieces)):
            if into:  # the format writes each chunk into its places
                buffers.update(plan.chunk_format.quantize_array_into(rows, row0, buffers, **opts))
                continue
            lent = self._lent(plan, pieces, row0, rows.shape[0])
            kw = {**opts, "into": lent} if lent else opts
            for key, part in plan.chunk_format.quantize_array(rows, **kw).items():
                axis = plan.axes[key]
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

    def _in_place(self, plan: Any, pieces: dict[str, OutPiece]) -> RowsInto | None:
        """Where the target stores BF16 rows as they come (``stores_bf16_rows``) and the
        writer maps the output: the source's kernel computes each block of rows straight into
        the output's pages (``PieceWriter.destination``), and their write copies nothing."""
        if not plan.chunk_format.stores_bf16_rows or plan.axes.get("weight") != 0:
            return None
        piece = pieces["weight"]  # [out, in] BF16
        return lambda r, rows: self._rows_of(piece, r, rows)

    def _rows_of(self, piece: OutPiece, row0: int, n: int) -> np.ndarray | None:
        """The output's mapped pages of rows ``row0 .. row0 + n`` of ``piece`` (rows-major:
        [rows, ...] as its meta says, in its dtype), for a kernel to compute into; None where
        the writer does not lend them (a disk: ``pwrite``) or the piece has no rows."""
        total, *rest = piece.meta.shape
        if not total:
            return None
        at = piece.offset + row0 * (piece.meta.nbytes // total)
        return self.out.destination(piece.tensor, at, (n, *rest), numpy_dtype(piece.meta.dtype))

    def _lent(self, plan: Any, pieces: dict[str, OutPiece], row0: int, n: int) -> dict[str, np.ndarray]:  # fmt: skip
        """The output's mapped pages of rows ``row0 .. row0 + n`` of each key the chunk format
        quantizes into (``quantizes_rows_into``, along the rows), where the writer lends them
        (``PieceWriter.destination``): the kernel computes there, and their write copies
        nothing. Empty where it does not (a disk: ``pwrite``)."""
        lent = {}
        for key in plan.chunk_format.quantizes_rows_into:
            if key in pieces and plan.axes.get(key) == 0:
                dest = self._rows_of(pieces[key], row0, n)
                if dest is not None:
                    lent[key] = dest
        return lent

    def _absmax(self, job: Job) -> float:
        """``max |W|`` over the job's weight and the others of its merged module (their shared
        per-tensor scale: ``Job.amax_group``), by the kernels. Every value is kept (a float
        per weight): a group's members need the same ones, and the plan lists all of a
        layer's expert gates before their ups, so a short memory would compute each twice."""
        names = job.amax_group or job.sources
        for name in names:
            if name not in self._amax:
                self._amax[name] = self.source.absmax_array(name)
        return max(self._amax[name] for name in names)

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
        lend = job.target.fmt.native_rows_into
        for (r, g), (_, u) in zip(rows(gate), rows(up), strict=True):
            into = self._packed_rows(lend, pieces["gate_up_packed"], 2 * r, 2 * g.shape[0])
            packed, scale = quantize(g, u, **into)  # gate and up rows interleaved
            self._write(pieces["gate_up_packed"], packed, 2 * r * packed.shape[1])
            self._write(pieces["gate_up_scale"], scale, 2 * r * scale.itemsize)
        for r, d in rows(down):
            into = self._packed_rows(lend, pieces["down_packed"], r, d.shape[0])
            packed, scale = quantize(d, **into)
            self._write(pieces["down_packed"], packed, r * packed.shape[1])
            self._write(pieces["down_scale"], scale, r * scale.itemsize)

    def _packed_rows(self, lend: bool, piece: OutPiece, row: int, n: int) -> dict[str, Any]:
        """``{"into": the mapped output of packed rows row .. row + n of an expert's part of a
        stacked tensor (piece)}`` where the format computes into it (``lend``:
        ``native_rows_into``) and the writer lends its pages; else nothing
        (``quantize_rows_array``'s keywords)."""
        dest = self._rows_of(piece, row, n) if lend else None
        return {} if dest is None else {"into": dest}

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
