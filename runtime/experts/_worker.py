"""Subpool worker threads of the CPU expert pool: pinning, OpenMP, and touching or copying a share.

Each subpool's thread starts in ``_init_worker``. At open it either *touches* one byte per page
of its views (``_touch``, ``materialize=False``: faults the mapping in from that thread) or, with
``materialize=True``, copies its share into private memory that it allocates and writes itself
(``_private_copy``: first touch, on transparent huge pages where the kernel gives them), after
which the files are unmapped. The native GEMV kernel's own worker threads are started by the
subpool thread, so they inherit its CPU affinity.

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

Threads. Subpool threads run their per-expert torch glue on one OpenMP thread (their own
OpenMP setting; the caller's is untouched): otherwise each subpool thread gets its own OpenMP
team whose barrier spinning competes with the kernel (see ``_init_worker``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from hetquant.formats import HetquantError

__all__ = ["_PAGE", "_cpu_sets", "_init_worker", "_omp_library", "_private_copy", "_touch"]

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
