"""One rank's forward steps in a run: its pipeline stage, the hidden states handed between
stages, greedy generation, and what the rank measured.

Tensors crossing ranks (hidden states to the next stage, the next token) live on ``link``: the
rank's device under a device-native backend (nccl, hccl) — no host copies — or the host under
gloo (``collectives.wire``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RankTiming", "StagePlace", "generate", "stage_step"]


@dataclass(frozen=True)
class RankTiming:
    """What one rank measured, wall-clock seconds: its process groups' set-up (``init_s``),
    the load (``open_artifact`` until the tensors are on its device and the CPU expert pool is
    open), and each forward step (``steps_s``: the prefill, then one per generated token; the
    device synchronized at the end of each)."""

    rank: int
    backend: str | None
    device: str
    init_s: float
    load_s: float
    steps_s: tuple[float, ...]


@dataclass(frozen=True)
class StagePlace:
    """Where a rank sits: stage ``stage`` of ``stages``, rank ``grank`` of its stage's group of
    ``size`` ranks; global rank = ``stage · size + grank``."""

    stage: int
    stages: int
    grank: int
    size: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def peer(self, stage: int) -> int:
        """Global rank of this group rank in ``stage``."""
        return stage * self.size + self.grank


def generate(
    model: Any,
    layers: range,
    tokens: tuple[int, ...],
    k: int,
    place: StagePlace,
    link: torch.device,
    grouped: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, list[float]]:
    """Prefill ``tokens``, then ``k`` greedy steps (full re-prefill), the next token broadcast
    from the last stage's group rank 0 when ``grouped`` (a process group exists).

    Returns (the prefill's float32 logits [T, V] on the last stage's group rank 0, else None;
    the token ids [T + k] on ``link``; each step's seconds, ``model.weights.device``
    synchronized)."""
    import torch.distributed as dist

    seq = torch.tensor(tokens, dtype=torch.long).to(link)  # [T], from the host once
    logits, steps = None, []
    for step in range(k + 1):
        tick = time.perf_counter()
        y = stage_step(model, layers, seq, place, link)
        if step == 0:
            logits = y
        if step < k:
            nxt = torch.zeros(1, dtype=torch.long, device=link)
            if y is not None:
                nxt = y[-1].argmax().reshape(1).to(link)
            if grouped:
                dist.broadcast(nxt, src=(place.stages - 1) * place.size)
            seq = torch.cat([seq, nxt])  # [T + step + 1]
        _sync(model.weights.device)
        steps.append(time.perf_counter() - tick)
    return logits, seq, steps


def stage_step(
    model: Any, layers: range, seq: torch.Tensor, place: StagePlace, link: torch.device
) -> torch.Tensor | None:
    """Run this stage on token ids ``seq`` [T] (first stage) or the previous stage's hidden
    states (``model.hidden_shape(T)``, received on ``link``); send its hidden states on (on ``link``). Returns the
    logits [T, V] on the last stage's group rank 0, else None."""
    import torch.distributed as dist

    from .rank import run_stage

    x: torch.Tensor = seq
    if not place.first:
        x = torch.empty(model.hidden_shape(seq.shape[0]), dtype=model.dtype, device=link)
        dist.recv(x, src=place.peer(place.stage - 1))
    y = run_stage(model, layers, x, first=place.first, last=place.last, tokens=seq)
    if not place.last:
        dist.send(y.contiguous().to(link), dst=place.peer(place.stage + 1))
        return None
    return y if place.grank == 0 else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
