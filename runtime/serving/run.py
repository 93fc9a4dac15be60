"""``hetquant run``: spawn the ranks of a layout on this host, load, run a token sequence.

World = ``pp_size × g`` processes, ``g = max(tp_size, ep_size)`` (tp and ep, when both > 1, are
the same group, as vLLM's EP runs over the TP group). Rank ``r`` is stage ``r // g``, group rank
``r % g``; each stage's group does its collectives, and a stage hands its hidden states to the
same group rank of the next stage. The collectives' backend is the device's own — gloo on the
CPU, nccl on CUDA (each rank on its own GPU, ``cuda:{r}``: tensors never leave it), hccl on
Ascend — or the one named in ``RunSpec.dist_backend`` (gloo on a GPU: ranks may share it,
collectives go through host copies); see ``collectives.py``. One rank makes no process group
unless a backend is named. The last stage's group rank 0 writes the float32 logits ``[T, vocab]``;
with ``generate`` the next token (greedy, full re-prefill per step) is broadcast to every rank. A
hybrid artifact's routed experts come from the CPU expert pool (``subpools``), run on the host
by group rank 0 of each stage.

This module is the parent's side (the spec, the checks before spawning, the spawn) and
``local_model``; what a rank does is in ``run_rank.py``.
"""

from __future__ import annotations

import json
import logging
import pickle
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetquant.formats import HetquantError

from .collectives import CollectiveBackend, choose_backend, rendezvous
from .run_rank import (
    _check_kv_cache,
    _layout,
    _npu_ops,
    _rank_entry,
    _rank_main,
    _reference,
    _Where,
)

__all__ = ["RunSpec", "local_model", "run_artifact"]

log = logging.getLogger("hetquant.run")


@dataclass(frozen=True)
class RunSpec:
    artifact: str
    tokens: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    ep: int = 1
    subpools: int = 1
    device: str = "cpu"
    generate: int = 0
    dtype: str | None = None  # activations; default float32, bfloat16 on npu (as vllm-ascend)
    dist_backend: str | None = None  # torch.distributed backend; default the device's own
    join_timeout: float = 180.0  # seconds a rank waits for the store and the other ranks
    kv_cache: str | None = None  # an engine's KV-cache storage to emulate (forward/kv_cache.py)

    @property
    def world(self) -> int:
        return self.pp * self.group

    def collective_backend(self) -> CollectiveBackend | None:
        """The ranks' backend (refused here when it cannot run); None: one rank, none named,
        no process group."""
        if self.world == 1 and self.dist_backend is None:
            return None
        return choose_backend(self.device, self.dist_backend, self.world)

    @property
    def act_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype or ("bfloat16" if self.device == "npu" else "float32"))

    @property
    def group(self) -> int:
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise HetquantError(
                f"tp {self.tp} and ep {self.ep}: with both > 1 they must be equal (one group)"
            )
        return max(self.tp, self.ep)


def run_artifact(
    spec: RunSpec, *, timings: list[dict[str, Any]] | None = None
) -> tuple[np.ndarray, list[int]]:
    """(float32 logits [T, vocab] of ``spec.tokens``, generated token ids) — spawning the ranks.

    Everything a rank would refuse is checked here first (backend, layout, token ids, every
    file's header); a rank that fails anyway re-raises its HetquantError or OSError in this
    process. ``timings``, when given, receives one dict per rank (``RankTiming``).
    """
    world = spec.world
    backend, art = _check_inputs(spec, world)  # ``art`` pins the artifact the ranks must load
    log.info(
        "starting %d rank(s) (tp=%d pp=%d ep=%d, %s) on this host",
        world, spec.tp, spec.pp, spec.ep, backend.name if backend else "no process group",
    )  # fmt: skip
    level = logging.getLogger("hetquant").getEffectiveLevel()
    store = rendezvous(spec.join_timeout) if backend is not None else None
    where = (store.port if store is not None else 0, art.generation)
    with tempfile.TemporaryDirectory(prefix="hetquant-run-") as tmp:
        out = Path(tmp)
        if backend is None:
            _rank_main(0, spec, 1, where, out, time.time())
        else:
            _spawn(spec, world, where, out, level)
        logits = np.load(out / "logits.npy")
        generated = [int(x) for x in np.load(out / "generated.npy")]
        if timings is not None:
            timings.extend(json.loads((out / f"timing-{r}.json").read_text()) for r in range(world))
    return logits, generated


def _check_inputs(spec: RunSpec, world: int) -> tuple[CollectiveBackend | None, Any]:
    """Refuse what a rank would: no tokens, a backend that cannot run here, ids outside the
    vocab, a layout the shapes do not allow, a missing or truncated file (every header is read,
    cpu_experts/ included). Returns the ranks' backend (None: one rank, no process group) and
    the opened artifact, which every rank must load (``open_artifact(generation=)``)."""
    if not spec.tokens:
        raise HetquantError("run: give at least one token id (--tokens 5,17,42)")
    backend = spec.collective_backend()
    from ..experts._expert_files import _select_layers
    from ..experts._routing import _check_split
    from ..forward.model import check_runnable
    from ..loading.loader import open_artifact

    art = open_artifact(spec.artifact)  # headers only: refuse a bad layout before spawning
    check_runnable(art.cfg)
    _check_kv_cache(spec, art.cfg)
    vocab = art.cfg.vocab_size  # a VLM's is its text config's
    bad = [t for t in spec.tokens if not 0 <= t < vocab]
    if bad:
        raise HetquantError(
            f"token ids must lie in [0, {vocab}) (vocab_size of {spec.artifact}); got {bad[:5]}"
        )
    for rank in range(world):
        art.check(_layout(spec, rank))
    experts = art.cpu_expert_files
    if experts:  # every layer file's header, as CpuExpertPool.open reads them in each rank
        _check_split(_select_layers(art.root, None, check=False), spec.subpools, "inter")
    log.info(
        "checked %s: %d root shard(s), %d cpu_experts file(s)",
        spec.artifact,
        len({f for m in art.modules.values() for f, _ in m.entries.values()}),
        len(experts),
    )
    return backend, art


def _spawn(spec: RunSpec, world: int, where: _Where, out: Path, level: int) -> None:
    """``world`` ranks via torch.multiprocessing; a failed rank's error is raised here (one
    line: its HetquantError or OSError, its death, or the last line of its traceback)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    quiet = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process …": the
    saved = quiet.level  # others, once one failed; the error line says which (-v: kept)
    quiet.setLevel(max(saved, logging.ERROR) if level > logging.DEBUG else saved)
    try:
        mp.spawn(_rank_entry, args=(spec, world, where, out, level, time.time()), nprocs=world)
    except ProcessException as e:
        failed = sorted(out.glob("error-*.pkl"), key=lambda p: int(p.stem.split("-")[1]))
        if failed:
            raise pickle.loads(failed[0].read_bytes()) from None
        if isinstance(e, ProcessExitedException):  # killed (OOM killer, a signal)
            how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
            raise HetquantError(f"run: rank {e.error_index} of {world} died ({how})") from None
        log.debug("rank %d of %d: %s", e.error_index, world, e.msg)  # its traceback, with -v
        last = [x for x in str(e.msg).splitlines() if x.strip()][-1:] or ["?"]
        raise HetquantError(f"run: rank {e.error_index} of {world} failed: {last[0]}") from None
    finally:
        quiet.setLevel(saved)


def local_model(
    artifact: str | Path, *, device: str = "cpu", subpools: int = 1, dtype: str | None = None,
    kv_cache: str | None = None,
) -> Any:  # fmt: skip
    """The whole artifact on one rank of this process, run through its quantized ops (W8A8
    activation quantization included): the family's reference forward (``references.py``) whose ``forward`` maps tokens
    [T] to float32 logits [T, vocab]."""
    from ..loading.loader import open_artifact
    from ..parallel.layout import ParallelLayout
    from .collectives import rank_device
    from .rank import RankWeights

    spec = RunSpec(
        str(artifact), (0,), device=device, subpools=subpools, dtype=dtype, kv_cache=kv_cache
    )
    art = open_artifact(
        artifact
    )  # headers and config parsed once (tests/runtime/parallel/test_placement.py)
    _check_kv_cache(spec, art.cfg)
    layout = ParallelLayout()
    cfg = art.cfg
    tensors = art.load(layout, device=rank_device(device, 0, 0, None))
    pool = art.cpu_expert_pool(subpools=subpools) if art.cpu_expert_files else None
    weights = RankWeights(
        tensors, art.placement, layout, backend=device, pool=pool, npu_ops=_npu_ops(device)
    )
    return _reference(cfg, weights, spec)
