"""Subpools of the CPU expert pool: one worker thread each, pinned, touching or copying its share.

Each subpool of :class:`~hetquant.runtime.experts.expert_pool.CpuExpertPool` has its own worker thread
(``_Subpool``: one ``ThreadPoolExecutor`` of one thread); that thread prepares the subpool's share
at open (``_Subpool.prepare``) and computes its partial sums in ``forward`` (``_Subpool.partial``),
which the caller adds up in subpool order (so results are deterministic). At open, the thread
either *touches* one byte per page of its views (``_touch``, ``materialize=False``: faults the
mapping in from that thread) or, with ``materialize=True``, copies its share into private memory
that it allocates and writes itself (``_private_copy``: first touch), after which the files are
unmapped. The native GEMV kernel's own worker threads are started by the subpool thread, so they
inherit its CPU affinity. ``_expert_block`` and ``_check_split`` say which part of each layer a
subpool owns.

NUMA placement. Linux places a private page on the node of the CPU that first writes it, so a
NUMA deployment passes ``cpus``: one CPU set per subpool (checked by ``_cpu_sets``), e.g. for two
sockets of 64 cores ``cpus=[range(0, 64), range(64, 128)]`` (``lscpu -p=CPU,NODE`` or
``/sys/devices/system/node/nodeN/cpulist`` give the sets). Each worker pins itself with
``os.sched_setaffinity(0, cpus[s])`` — which on Linux pins the calling thread only — before it
touches or copies anything, and ``materialize=True`` then puts each subpool's weights on its own
node. Without ``materialize`` the weights stay page cache: a page lands on the node of whichever
process read the file first, and with ``split="inter"`` the down projection cannot be separated
anyway (a ``down_packed`` row holds every subpool's slice, ``I/2`` bytes, so each 4 KB page
mixes subpools). For NUMA, use ``materialize=True`` (memory as kt-kernel: the whole layer set
once, in anonymous memory), or ``split="experts"`` on a cold page cache: whole experts are
contiguous byte ranges, so each pinned subpool's touch reads its own experts into page cache on
its node (pages already cached stay where they are).

Compute. The kernels of a layer come from its format (``ExpertLayerFormat.cpu_kernel``, looked
up in ``runtime/kernels/registry.py``: ``int4`` for ``int4_cpu`` / ``int4_cpu_group``,
``fp4_e2m1`` for ``fp4_cpu_experts``). A subpool's share of ``forward`` (``_Subpool.partial``)
is one call of the family's fused MoE kernel where it has one and takes the call —
:func:`~hetquant.runtime.kernels.int4_moe.int4_moe` for all its experts (``fused=True``, the
default, per-channel experts): every token's activation digits once, the subpool's kernel
threads splitting each expert's weight rows between them, no Python between experts. Otherwise
— FP4 (no fused kernel), grouped scales, backend ``"torch"``, more than ``MAX_NATIVE_TOKENS``
tokens on one expert, non-finite activations, or ``fused=False`` (the reference for tests and
A/B benchmarks) — a loop over its experts: two calls of the family's GEMV and torch glue each,
with the same bits for the same kernel path (``acts``, then ``down_rows``; a layer whose
format splits ``down`` by rows runs the two as separate phases across the subpools:
``expert_pool.CpuExpertPool._run_rows``).

Threads. Subpool threads run their per-expert torch glue on one OpenMP thread (their own
OpenMP setting; the caller's is untouched): otherwise each subpool thread gets its own OpenMP
team whose barrier spinning competes with the kernel (see ``_init_worker``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from hetquant.formats import HetquantError

from ..forward.moe import swiglu
from ..kernels import fp4_gemv as _fp4_gemv  # noqa: F401  (registers the FP4 kernels)
from ..kernels import int4_moe as _int4_moe  # noqa: F401  (registers the INT4 kernels)
from ..kernels.registry import ExpertKernels, expert_kernels
from ._expert_files import ExpertLayerInfo

__all__ = [
    "_PAGE",
    "Routing",
    "_Subpool",
    "_check_split",
    "_cpu_sets",
    "_expert_block",
    "_init_worker",
    "_omp_library",
    "_private_copy",
    "_touch",
]

_PAGE = mmap.PAGESIZE


def _cpu_sets(cpus: Sequence[Iterable[int]] | None, subpools: int) -> list[frozenset[int] | None]:
    """One CPU set per subpool (None: unpinned), checked against this process's affinity."""
    cpu_sets: list[frozenset[int] | None] = [None] * subpools
    if cpus is not None:
        cpu_sets = [frozenset(int(c) for c in cs) for cs in cpus]
        if len(cpu_sets) != subpools or not all(cpu_sets):
            raise HetquantError(
                f"CpuExpertPool: cpus must give one non-empty CPU set per subpool "
                f"({subpools}), got {len(cpu_sets)}"
            )
        allowed = os.sched_getaffinity(0)
        bad = sorted(set().union(*cpu_sets) - allowed)
        if bad:
            raise HetquantError(
                f"CpuExpertPool: CPU(s) {bad} are not available to this process "
                f"(allowed: {sorted(allowed)})"
            )
    return cpu_sets


def _omp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp / libiomp), found in this process's maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libgomp" in path or "libiomp" in path:
                    return ctypes.CDLL(path)  # already loaded: the same handle
    except OSError:
        pass
    return None


def _init_worker(cpus: frozenset[int] | None) -> None:
    """Subpool thread start: pin to ``cpus``; run this thread's torch ops on one OpenMP thread.

    The per-expert torch ops of a subpool (gather, SiLU, scatter-add) are small; the subpool's
    parallelism is the native kernel's own threads. Left alone, each subpool thread would get its
    own OpenMP team, and on a machine with few cores the teams' barrier spinning takes the CPUs
    from the kernel (measured on 2 vCPUs: 288 ms instead of 11 ms per token and layer).
    ``omp_set_num_threads`` changes only the calling thread's setting (an OpenMP ICV), after
    torch's lazy per-thread initialisation has run; the caller's threads are untouched.
    """
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # 0 = the calling thread on Linux
    torch.get_num_threads()  # runs torch's per-thread OpenMP initialisation first
    lib = _omp_library()
    if lib is not None and hasattr(lib, "omp_set_num_threads"):
        lib.omp_set_num_threads(1)


def _touch(t: torch.Tensor) -> None:
    """Read one byte in every page that ``t`` occupies: the first byte of each row, then one
    every page along it (rows may be strided, as in a subpool slice of ``down_packed``)."""
    if t.numel():
        int(t.view(torch.uint8)[..., ::_PAGE].sum())


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True) if hasattr(os, "sched_setaffinity") else None
    except OSError:
        return None


_LIBC = _libc()
_HUGE = 2 << 20  # x86-64 / aarch64 (4 KB granule) transparent huge page
_MADV_HUGEPAGE = 14


def _ask_huge_pages(t: torch.Tensor) -> None:
    """``madvise(MADV_HUGEPAGE)`` on the 2 MB-aligned interior of ``t``'s fresh, untouched memory:
    with transparent huge pages set to ``madvise`` (or ``always``), the first touch then maps
    2 MB pages, so the kernel's weight streams cross a page (a TLB miss, a stop for the hardware
    prefetcher) every 2 MB instead of every 4 KB, as kt-kernel's copies in ``aligned_alloc``'d
    memory may. Linux only; a refusal (THP ``never``) changes nothing."""
    n = t.numel() * t.element_size()
    a = -(-t.data_ptr() // _HUGE) * _HUGE
    b = (t.data_ptr() + n) // _HUGE * _HUGE
    if _LIBC is not None and b > a:
        _LIBC.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_HUGEPAGE)


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy allocated and written by the calling thread (first touch), on
    transparent huge pages where the kernel gives them (``_ask_huge_pages``)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    _ask_huge_pages(out)
    if t.numel():
        # numpy's copy runs in this thread (torch's copy_ may hand it to its OpenMP workers).
        np.copyto(out.view(torch.uint8).numpy(), t.view(torch.uint8).numpy())
    return out


class _Subpool:
    def __init__(self, index: int, cpus: frozenset[int] | None) -> None:
        self.index = index
        self.cpus = cpus
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.kernels: dict[int, ExpertKernels] = {}  # per layer, from its format (registry)
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"hetquant-subpool{index}",
            initializer=_init_worker,
            initargs=(cpus,),
        )

    def submit(self, fn, *args) -> Future:
        return self.executor.submit(fn, *args)

    def nbytes(self) -> int:
        total = 0
        for views in self.tensors.values():
            total += sum(v.numel() * v.element_size() for v in views.values())
        return total

    def prepare(
        self,
        infos: dict[int, ExpertLayerInfo],
        layer_views: Callable[[ExpertLayerInfo], dict[str, torch.Tensor]],
        n: int,
        split: str,
        materialize: bool,
    ) -> None:
        """Runs in this subpool's thread: take its views, then touch or copy them."""
        for layer, info in infos.items():
            self.kernels[layer] = expert_kernels(info.fmt)
            full = layer_views(info)
            if split == "inter":
                views = info.fmt.subpool_slice(full, self.index, n)
            else:
                a, b = _expert_block(info.num_experts, self.index, n)
                views = {k: v[a:b] for k, v in full.items()}
            if materialize:
                views = {k: _private_copy(v) for k, v in views.items()}
            else:
                for v in views.values():
                    _touch(v)
            self.tensors[layer] = views

    def partial(
        self, layer: int, e0: int, x32: torch.Tensor, r: Routing, kw: dict[str, Any]
    ) -> torch.Tensor:
        """Runs in this subpool's thread: its share of the expert sum, float32 [T, H]; ``e0`` is
        its first expert, ``kw`` the ``int4_gemv`` options plus ``fused`` (module docstring)."""
        t, k = self.tensors[layer], self.kernels[layer]
        kw = dict(kw)
        if kw.pop("fused") and k.moe is not None:  # never with a SwiGLU clip (_run)
            kw.pop("limit", None)
            out = k.moe(t, x32, r.experts - e0, r.offsets, r.tokens, r.weights, **kw)
            if out is not None:
                return out
        return self.down_rows(layer, e0, self.acts(layer, e0, x32, r, kw), r, kw, x32.shape)

    def acts(
        self, layer: int, e0: int, x32: torch.Tensor, r: Routing, kw: dict[str, Any]
    ) -> list[torch.Tensor]:
        """Runs in this subpool's thread: each routed expert's activations ``silu(gate) · up``
        on this subpool's gate / up rows, [n_g, I/S], in ``r``'s expert order."""
        t, gemv = self.tensors[layer], self.kernels[layer].gemv
        limit = kw.get("limit")  # the SwiGLU clip (DeepSeek-V4's swiglu_limit)
        kw = {k: v for k, v in kw.items() if k not in ("fused", "limit")}
        out, bounds = [], r.offsets.tolist()
        for g, e in enumerate(r.experts.tolist()):
            xs = x32.index_select(0, r.tokens[bounds[g] : bounds[g + 1]])  # [n, H]
            gu = gemv(t["gate_up_packed"][e - e0], t["gate_up_scale"][e - e0], xs, **kw)
            out.append(swiglu(gu[:, 0::2], gu[:, 1::2], limit))  # [n, I/S]
        return out

    def down_rows(
        self,
        layer: int,
        e0: int,
        acts: list[torch.Tensor],
        r: Routing,
        kw: dict[str, Any],
        shape: torch.Size,
    ) -> torch.Tensor:
        """Runs in this subpool's thread: ``Σ_g weights · down(acts[g])`` on this subpool's down
        rows, [T, rows] (``shape``: [T, H] when it holds all of them)."""
        t, gemv = self.tensors[layer], self.kernels[layer].gemv
        kw = {k: v for k, v in kw.items() if k not in ("fused", "limit")}
        out = torch.zeros(shape[0], t["down_packed"].shape[1])
        bounds = r.offsets.tolist()
        for g, e in enumerate(r.experts.tolist()):
            a, b = bounds[g], bounds[g + 1]
            y = gemv(t["down_packed"][e - e0], t["down_scale"][e - e0], acts[g], **kw)
            out.index_add_(0, r.tokens[a:b], y * r.weights[a:b, None])
        return out


class Routing(NamedTuple):
    """Routed entries grouped by expert: expert ``experts[g]`` (ascending) takes the entries
    ``offsets[g] .. offsets[g+1]-1`` of ``tokens`` (int64) and ``weights`` (float32)."""

    experts: torch.Tensor
    offsets: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor

    def owned(self, start: int, stop: int) -> Routing | None:
        """The entries of experts ``start .. stop-1`` (None if there are none)."""
        a, b = torch.searchsorted(self.experts, torch.tensor([start, stop])).tolist()
        if a == b:
            return None
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        return Routing(
            self.experts[a:b], self.offsets[a : b + 1] - lo, self.tokens[lo:hi], self.weights[lo:hi]
        )


def _expert_block(num_experts: int, s: int, n: int) -> tuple[int, int]:
    return s * num_experts // n, (s + 1) * num_experts // n


def _check_split(infos: dict[int, ExpertLayerInfo], subpools: int, split: str) -> None:
    for info in infos.values():
        if split == "inter":
            try:
                info.fmt.check_subpools(info.inter, subpools)
            except HetquantError as e:
                raise HetquantError(
                    f"CpuExpertPool (layer {info.layer}, {info.fmt.name}): {e}; or split='experts'"
                ) from None
        elif subpools > info.num_experts:
            raise HetquantError(
                f"CpuExpertPool: {subpools} subpools for {info.num_experts} experts (layer "
                f"{info.layer}); split='experts' needs at most one subpool per expert"
            )
