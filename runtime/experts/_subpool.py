"""Subpools of the CPU expert pool: one worker thread each, pinned, touching or copying its share.

Each subpool of :class:`~hetquant.runtime.experts.expert_pool.CpuExpertPool` has its own worker thread
(``_Subpool``: one ``ThreadPoolExecutor`` of one thread); that thread prepares the subpool's share
at open (``_Subpool.prepare``) and computes its partial sums in ``forward`` (``_Subpool.partial``),
which the caller adds up in subpool order (so results are deterministic). At open, the thread
touches or copies its share, pinned to its CPUs (``_worker.py``: touching, private copies, NUMA
placement, OpenMP); ``_routing.py`` says which part of each layer a subpool owns
(``_expert_block``, ``_check_split``) and which routed entries reach it (``Routing``).

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
``_run_rows``).

Names: ``_PAGE``, ``_cpu_sets``, ``_init_worker``, ``_omp_library``, ``_private_copy`` and
``_touch`` (now in ``_worker.py``), ``Routing``, ``_check_split`` and ``_expert_block`` (now in
``_routing.py``) were defined here before that split and still import from this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..forward.moe import swiglu
from ..kernels import fp4_gemv as _fp4_gemv  # noqa: F401  (registers the FP4 kernels)
from ..kernels import int4_moe as _int4_moe  # noqa: F401  (registers the INT4 kernels)
from ..kernels.registry import ExpertKernels, expert_kernels
from ._expert_files import ExpertLayerInfo

# ``X as X``: names defined here before the split into _worker.py and _routing.py
from ._routing import Routing as Routing
from ._routing import _check_split as _check_split
from ._routing import _expert_block
from ._worker import _PAGE as _PAGE
from ._worker import _cpu_sets as _cpu_sets
from ._worker import _init_worker, _private_copy, _touch
from ._worker import _omp_library as _omp_library

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
    "_run_partials",
    "_run_rows",
    "_touch",
]


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


def _run_partials(
    subpools: Sequence[_Subpool],
    layer: int,
    x32: torch.Tensor,
    routing: Routing,
    kw: dict[str, Any],
    owned: Callable[[int], range],
) -> torch.Tensor:
    """The routed sum of ``layer``: each subpool's partial sum over the experts ``owned(s)``
    gives it (``_Subpool.partial``), added up in subpool order (deterministic); float32 [T, H]."""
    futures = []
    for sp in subpools:
        experts = owned(sp.index)
        mine = routing.owned(experts.start, experts.stop)
        if mine is not None:
            futures.append(sp.submit(sp.partial, layer, experts.start, x32, mine, kw))
    out: torch.Tensor | None = None
    for f in futures:  # subpool order: the sum is deterministic
        part = f.result()
        out = part if out is None else out.add_(part)
    return out if out is not None else torch.zeros_like(x32)


def _run_rows(
    subpools: Sequence[_Subpool], layer: int, x32: torch.Tensor, r: Routing, kw: dict[str, Any]
) -> torch.Tensor:
    """A layer whose subpools own rows of down (``subpool_down == "rows"``): every
    subpool's slice of each expert's activations, joined along I in subpool order, then
    each subpool's rows of the routed sum, joined along H: one pool's arithmetic, split."""
    sps = subpools
    parts = [f.result() for f in [sp.submit(sp.acts, layer, 0, x32, r, kw) for sp in sps]]
    acts = [torch.cat(per_expert, dim=1) for per_expert in zip(*parts, strict=True)]
    args = (layer, 0, acts, r, kw, x32.shape)
    ys = [f.result() for f in [sp.submit(sp.down_rows, *args) for sp in sps]]
    return torch.cat(ys, dim=1)
