"""One rank of ``hetquant run`` (``run.py`` spawns them): join the ranks' groups, open the artifact
the parent checked, load this rank's shards (and the CPU expert pool), run its pipeline stages
through the family's reference forward, write the logits and its timing.

Also what ``run.py``'s ``local_model`` shares with a rank: its ``ParallelLayout`` (``_layout``),
the npu ops (``_npu_ops``: the CPU emulation of torch_npu's contracts when
``HETQUANT_NPU_EMULATION=1``), the KV-cache check (``_check_kv_cache``) and the family's
reference forward in the spec's activation dtype (``_reference``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hetquant.formats import HetquantError

if TYPE_CHECKING:
    from .run import RunSpec

__all__ = ["_check_kv_cache", "_layout", "_npu_ops", "_rank_entry", "_rank_main", "_reference"]

log = logging.getLogger("hetquant.run")
_Where = tuple[int, Any]  # (port of the ranks' store, the artifact's generation)


def _rank_entry(
    rank: int, spec: RunSpec, world: int, where: _Where, out: Path, level: int, t0: float
) -> None:
    """A spawned rank: logs like the parent; a HetquantError / OSError goes back to it."""
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        _rank_main(rank, spec, world, where, out, t0)
    except (HetquantError, OSError) as e:
        (out / f"error-{rank}.pkl").write_bytes(pickle.dumps(e))
        raise SystemExit(2) from None


def _rank_main(rank: int, spec: RunSpec, world: int, where: _Where, out: Path, t0: float) -> None:
    """Rank ``rank`` of ``world``: load its shards, run the stages; ``where``: the port of the
    ranks' store and the artifact's generation the parent checked; ``t0``: when the ranks were
    started (time.time()), for the progress log. Writes the logits and generated ids (last
    stage's group rank 0) and its ``RankTiming`` into ``out``."""
    import torch.distributed as dist

    from ..loading.loader import open_artifact
    from .collectives import Comm, init_groups, join_store, rank_device
    from .pipeline import RankTiming, StagePlace, generate
    from .rank import RankWeights

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = spec.collective_backend()
    place = StagePlace(rank // spec.group, spec.pp, rank % spec.group, spec.group)
    device = rank_device(spec.device, rank, place.grank, backend)
    tick = time.perf_counter()
    comm, link = Comm(), device
    port, generation = where
    if backend is not None:
        store = join_store(port, spec.join_timeout, rank, world)
        comm, link = init_groups(backend, store, rank, spec.pp, spec.group, device)
    init_s, tick = time.perf_counter() - tick, time.perf_counter()
    layout = _layout(spec, rank)
    art = open_artifact(spec.artifact, generation=generation)
    cfg = art.cfg
    tensors = art.load(layout, device=device)
    pool = art.cpu_expert_pool(subpools=spec.subpools) if art.cpu_expert_files else None
    load_s = time.perf_counter() - tick
    weights = RankWeights(
        tensors,
        art.placement,
        layout,
        backend=spec.device,
        comm=comm,
        pool=pool,
        npu_ops=_npu_ops(spec.device),
    )
    model = _reference(cfg, weights, spec)
    nbytes = sum(t.nbytes for t in tensors.values())
    log.info(
        "rank %d of %d: loaded %d tensors (%.1f MB) onto %s%s, %.1f s after start",
        rank, world, len(tensors), nbytes / 1e6, device, " and the CPU expert pool" if pool else "",
        time.time() - t0,
    )  # fmt: skip
    if rank == 0:
        more = f", then generating {spec.generate}" if spec.generate else ""
        log.info("running %d tokens%s", len(spec.tokens), more)
    layers = layout.stage_layers(cfg.num_hidden_layers)
    grouped = backend is not None
    logits, seq, steps = generate(model, layers, spec.tokens, spec.generate, place, link, grouped)
    if logits is not None:
        np.save(out / "logits.npy", logits.cpu().numpy())
        np.save(out / "generated.npy", seq[len(spec.tokens) :].cpu().numpy())
    name = backend.name if backend else None
    timing = RankTiming(rank, name, str(device), init_s, load_s, tuple(steps))
    (out / f"timing-{rank}.json").write_text(json.dumps(asdict(timing)))
    if pool is not None:
        pool.close()
    if grouped:
        dist.barrier()
        dist.destroy_process_group()


def _layout(spec: RunSpec, rank: int) -> Any:
    from ..parallel.layout import ParallelLayout

    stage, grank = divmod(rank, spec.group)
    return ParallelLayout(
        tp_size=spec.tp, tp_rank=grank if spec.tp > 1 else 0, pp_size=spec.pp, pp_rank=stage,
        ep_size=spec.ep, ep_rank=grank if spec.ep > 1 else 0,
    )  # fmt: skip


def _npu_ops(device: str) -> Any:
    if device != "npu":
        return None
    if (
        os.environ.get("HETQUANT_NPU_EMULATION") == "1"
    ):  # tests: torch_npu's documented contracts, on CPU
        from ..kernels import npu_emulation

        return npu_emulation
    return None  # the npu backend imports the real torch_npu


def _check_kv_cache(spec: RunSpec, cfg: Any) -> None:
    """Refuse a KV-cache emulation the family's reference forward does not take."""
    from ..forward.kv_cache import kv_cache
    from ..forward.references import reference_for

    kv_cache(spec.kv_cache)  # a known name
    takes = reference_for(cfg).kv_caches
    if spec.kv_cache is not None and spec.kv_cache not in takes:
        raise HetquantError(f"--kv-cache {spec.kv_cache}: the {cfg.family.name} forward emulates "
                            f"{', '.join(takes) or 'no KV cache'}; leave it out")  # fmt: skip


def _reference(cfg: Any, weights: Any, spec: RunSpec) -> Any:
    """The family's reference forward over ``weights`` in the spec's activation dtype (and KV-cache
    emulation, when one is named)."""
    from ..forward.references import reference_for

    extra = {} if spec.kv_cache is None else {"kv_cache": spec.kv_cache}
    return reference_for(cfg)(cfg, weights, dtype=spec.act_dtype, **extra)
