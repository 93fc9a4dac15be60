"""Python's cycle collector, kept off the big acyclic graphs hetquant builds from headers.

Opening a source (every shard's header, a role per tensor) and planning its conversion (a job per
tensor, an output piece per stored tensor) each build hundreds of thousands of long-lived objects
and no reference cycles. The collector runs a full pass whenever the survivors grew by a quarter,
and each full pass walks every object made so far. On DeepSeek-V3's layout
(``examples/deepseek-v3-layout``: 163 headers, 46,183 tensors; ~350,000 objects tracked after
opening it, ~620,000 after planning) that was a third of the work: ``SourceCheckpoint.open``
4.0 → 2.6 s and ``plan_for`` 2.7 → 1.8 s with it paused (2-vCPU VM; benchmarks/notes/
convert-scaling.md, twelfth round). So both run under :func:`paused_gc`: reference counting
still frees everything acyclic at once; only cycles wait for the next pass after it.

Turned back on, the collector still makes one full pass over all of it at its next collection
(0.2 s a pass on that layout). A command whose source and plan live until it ends (``hetquant
convert``) spares that pass and all later ones: after planning it holds them :func:`frozen`, in
the collector's permanent generation, until it ends.

Its pool's workers, forked after, inherit that generation: their collections never walk the
parent's graph either (nor write the object headers of pages they would otherwise share).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen", "paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cycle collector off for the block, back on after it where it was on (nests)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextmanager
def frozen() -> Iterator[None]:
    """Every object tracked now out of the collector's passes for the block (processes forked
    in it inherit that), back in them after it — unless some were frozen before (by the caller:
    theirs to undo)."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()
