"""Staged copies from files to a device: several reader threads, each with two pinned buffers.

A load to CUDA cannot DMA from the page cache, and one thread copying file bytes into pinned
memory tops out near memcpy speed of one core (~6 GB/s measured on an H200 host, against
~55 GB/s host-to-device). So the chunks of a file's spans are dealt round-robin to ``lanes``
threads; each thread ``preadv``s a chunk into one of its two pinned buffers (the GIL is released
during the read), hands it to the device asynchronously on its own stream, and reuses a buffer
only once the copy out of it has finished. ``Lane`` hides the device, so the pipeline also runs
(and is tested) with a CPU lane.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

__all__ = ["CudaLane", "Lane", "lane_count", "staged_copy"]

STAGE_BYTES = 16 << 20  # per buffer; a lane has two
MAX_LANES = 16


class Lane(Protocol):
    """One reader thread's buffers and its way to the device."""

    def next(self) -> torch.Tensor:
        """A free staging buffer (uint8, at least the chunk size), waiting for it if needed."""
        ...

    def send(self, buf: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``buf`` (filled) into ``dst`` (same size), possibly asynchronously."""
        ...

    def finish(self) -> None:
        """Wait until every ``send`` of this lane has completed."""
        ...


class CudaLane:
    """Two pinned buffers used in turn, copies on the lane's own CUDA stream."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))  # destinations allocated
        self.i = 1

    def next(self) -> torch.Tensor:
        self.i ^= 1
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()
        return self.bufs[self.i]

    def send(self, buf: torch.Tensor, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(buf, non_blocking=True)
            self.events[self.i] = torch.cuda.Event()
            self.events[self.i].record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()


def lane_count(chunks: int) -> int:
    """Reader threads for ``chunks`` chunks: up to ``MAX_LANES``, at most the CPUs we may use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_LANES, cpus or 1, chunks))


Chunk = tuple[Any, torch.Tensor]  # (what the reader reads, destination slice of that size)


def staged_copy(
    chunks: Sequence[Chunk],
    read: Callable[[Any, torch.Tensor], None],
    make_lane: Callable[[], Lane],
    lanes: int,
) -> None:
    """Fill every destination of ``chunks``: ``read(what, buf)`` fills a staging buffer, the
    lane sends it. Chunk ``i`` goes to lane ``i % lanes``, so the lanes read the file front to
    back together. Returns when every copy has completed; a reader's error is re-raised."""
    made = [make_lane() for _ in range(lanes)]

    def run(k: int) -> None:
        lane = made[k]
        try:
            for what, dst in _every(chunks, k, lanes):
                buf = lane.next()[: dst.numel()]
                read(what, buf)
                lane.send(buf, dst)
        finally:
            lane.finish()

    if lanes == 1:
        run(0)
        return
    with ThreadPoolExecutor(lanes, thread_name_prefix="hetquant-load") as pool:
        for fut in [pool.submit(run, k) for k in range(lanes)]:
            fut.result()


def _every(chunks: Sequence[Chunk], first: int, step: int) -> Iterator[Chunk]:
    for i in range(first, len(chunks), step):
        yield chunks[i]
