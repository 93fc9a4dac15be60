"""CPU expert pool: the routed experts of a hybrid artifact, memory-mapped and served by subpools.

``ascend-hybrid`` artifacts keep every routed MoE expert in ``cpu_experts/layer_XXX.safetensors``
in the ``int4_cpu`` layer layout (``formats/int4_cpu.py``: one F32 scale per row) or its
group-wise variant (``formats/int4_cpu_group.py``: BF16 scales per 32 / 64 / 128 inputs, e.g. Kimi
K2 Thinking's QAT experts kept as shipped); each layer's layout is read from its header (the
registered expert-layer format that recognises it). :class:`CpuExpertPool` opens them
from the manifest (``hetquant.json`` → ``parts.cpu_experts.files``) and the safetensors headers
— nothing from ``hetquant.convert`` — and computes the routed-expert sum of a layer::

    pool = CpuExpertPool.open("OUTPUT", subpools=2)          # split="inter" (default)
    y = pool.forward(layer, x, topk_ids, topk_weights)        # Σ_k w_k · expert_{id_k}(x), [T, H]
    y_e = pool.expert(layer, e, x)                            # one expert, x [..., H]

``forward`` has the signature of ``runtime.model.Weights.experts``, so a weights provider can
hand its routed experts to the pool.

Memory. The layer files are mapped copy-on-write and the tensors are zero-copy views; open reads
only the headers and the pages each subpool touches (files and mapping: ``_expert_files.py``).

Subpools (kt-kernel's NUMA thread pools, reference/cpu_experts.md §1.3). ``subpools=S`` with

- ``split="inter"`` (default): subpool ``s`` owns the intermediate slice ``[s·I/S, (s+1)·I/S)``
  of every expert, as views from the layout's ``subpool_slice`` (no requantization: a down scale
  covers its whole row, or a whole group inside one slice, so the partial sums add up exactly
  in real arithmetic). Needs ``I % S == 0`` and ``I/S`` even (per-channel) or a multiple of the
  group size (group-wise); otherwise open fails naming the legal ``S``. Every subpool works on
  every token.
- ``split="experts"``: subpool ``s`` owns the whole experts ``[⌊s·E/S⌋, ⌊(s+1)·E/S⌋)``
  (contiguous blocks; ``1 ≤ S ≤ E``). A token only reaches the subpools of its experts.

Each subpool has a worker thread that touches its share at open (or, with ``materialize=True``,
copies it into private memory, and the files are unmapped) and computes its partial sums, added
up in subpool order (deterministic). ``cpus``: one CPU set per subpool, to which its worker pins
itself (for NUMA, with ``materialize=True``); ``threads=``: the native kernel's threads per
subpool call. Threads, touching, copying and NUMA placement: ``_worker.py``.

Compute. Each subpool's share of ``forward`` is one native call of
:func:`~hetquant.runtime.kernels.int4_moe.int4_moe` (per-channel layers; ``fused=True``, the
default): activation digits once per token, the kernel threads splitting every expert's weight
rows by bytes, no Python between experts; bit-identical to the per-expert loop it replaced
(``fused=False``; also taken for group-wise layers, backend ``"torch"`` and the other cases
``int4_moe`` declines).

Numerics. Activations are computed in float32 whatever ``x``'s dtype (float32, bfloat16 or
float16) and the result is cast back to it. The GEMVs are those of
:mod:`hetquant.runtime.kernels.int4_gemv` (native kernel up to ``MAX_NATIVE_TOKENS`` tokens per expert,
else the torch path; ``backend=`` forces one; ``precision="fast"`` rounds activations to 14-bit
instead of 22-bit fixed point); a DeepSeek-V4 layer (``fp4_cpu_experts``) runs
:mod:`hetquant.runtime.kernels.fp4_gemv` (int8 activations per token and call). Its format
splits ``down`` by rows (``subpool_down = "rows"``), so ``split="inter"`` runs in two phases
(``_subpool._run_rows``): every subpool's activations of each expert, joined along I, then each
subpool's rows of the routed sum on all of them, joined along H — one pool's arithmetic, so
the same bits for any number of subpools. The kernels come from the layer's format
(``_subpool.py``). Routing weights are cast to ``x``'s dtype first, as
``runtime.moe.routed_experts`` (and DeepSeek's reference) does. The loader's
``open_artifact(dir).cpu_expert_pool(subpools, **options)`` (DESIGN.md) calls
``CpuExpertPool.open``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from hetquant.formats import HetquantError
from hetquant.formats.int4_cpu import LAYER_KEYS

from ..loading._pin import ManifestPin

# ``X as X``: names defined here before the split into _expert_files.py, _subpool.py,
# _routing.py and _worker.py
from ._expert_files import MANIFEST as MANIFEST
from ._expert_files import ExpertLayerInfo, _Mapping, _select_layers
from ._expert_files import _cpu_expert_files as _cpu_expert_files
from ._expert_files import _layers_of as _layers_of
from ._routing import SPLITS as SPLITS
from ._routing import Routing, _check_options, _check_split, _expert_block, _route
from ._subpool import _run_partials, _run_rows, _Subpool
from ._worker import _PAGE as _PAGE
from ._worker import _cpu_sets
from ._worker import _init_worker as _init_worker
from ._worker import _omp_library as _omp_library
from ._worker import _private_copy as _private_copy
from ._worker import _touch as _touch

__all__ = ["CpuExpertPool", "ExpertLayerInfo"]

_FLOAT_IN = (torch.float32, torch.bfloat16, torch.float16)


class CpuExpertPool:
    """Routed experts of a hybrid artifact, split over subpools (module docstring)."""

    def __init__(self) -> None:  # use CpuExpertPool.open
        self._infos: dict[int, ExpertLayerInfo] = {}
        self._maps: dict[Path, _Mapping] = {}
        self._subpools: list[_Subpool] = []
        self._split = "inter"
        self._materialized = False
        self._backend = "auto"
        self._precision = "high"
        self._threads = 1
        self._fused = True
        self._closed = False
        self._lock = threading.Lock()

    # -------------------------------------------------------------------- opening
    @classmethod
    def open(
        cls,
        artifact_dir: str | os.PathLike[str],
        subpools: int = 1,
        split: str = "inter",
        layers: Iterable[int] | None = None,
        *,
        materialize: bool = False,
        cpus: Sequence[Iterable[int]] | None = None,
        threads: int | None = None,
        backend: str = "auto",
        precision: str = "high",
        fused: bool = True,
    ) -> CpuExpertPool:
        """Open the ``cpu_experts`` part of ``artifact_dir``.

        ``layers``: the MoE layer numbers to load (default: all in the manifest).
        ``materialize``: copy each subpool's share into private memory (module docstring).
        ``cpus``: one CPU set per subpool; each subpool thread pins itself to its set.
        ``threads``: native-kernel threads per subpool call (default
        ``max(1, torch.get_num_threads() // subpools)``). ``backend``, ``precision``: passed to
        ``int4_gemv`` (``precision="fast"`` rounds activations to 14-bit instead of 22-bit fixed
        point, for about a third fewer dot-products). ``fused=False``: one ``int4_gemv`` call per
        expert and projection with torch glue between them (the path before ``int4_moe``; the
        same bits, slower; for tests and A/B benchmarks).
        """
        _check_options(subpools, split, backend, precision)
        cpu_sets = _cpu_sets(cpus, subpools)
        artifact = Path(artifact_dir)
        pin = ManifestPin(artifact)  # the files mapped are all of one artifact (loading/_pin.py)
        infos = _select_layers(artifact, layers)
        _check_split(infos, subpools, split)

        pool = cls()
        pool._infos = dict(sorted(infos.items()))
        pool._split = split
        pool._materialized = materialize
        pool._backend = backend
        pool._precision = precision
        pool._fused = bool(fused)
        pool._threads = (
            int(threads) if threads is not None else max(1, torch.get_num_threads() // subpools)
        )
        try:
            for info in pool._infos.values():
                if info.path not in pool._maps:
                    pool._maps[info.path] = _Mapping(info.path)
            pin.check("while its CPU experts were being opened")
            pool._subpools = [_Subpool(s, cpu_sets[s]) for s in range(subpools)]
            args = (pool._infos, pool._layer_views, subpools, split, materialize)
            futures = [sp.submit(sp.prepare, *args) for sp in pool._subpools]
            for f in futures:
                f.result()
            if materialize:
                for m in pool._maps.values():
                    m.close()
                pool._maps.clear()
        except BaseException:
            pool.close()
            raise
        finally:
            pin.close()
        return pool

    def _layer_views(self, info: ExpertLayerInfo) -> dict[str, torch.Tensor]:
        m = self._maps[info.path]
        return {k: m.view(info.entries[k]) for k in LAYER_KEYS}

    # -------------------------------------------------------------------- properties
    @property
    def layers(self) -> list[int]:
        return list(self._infos)

    @property
    def num_subpools(self) -> int:
        return len(self._subpools)

    @property
    def split(self) -> str:
        return self._split

    @property
    def materialized(self) -> bool:
        return self._materialized

    def info(self, layer: int) -> ExpertLayerInfo:
        try:
            return self._infos[layer]
        except KeyError:
            raise HetquantError(
                f"CpuExpertPool: layer {layer} not in the pool (layers {self.layers})"
            ) from None

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` addresses of the file mappings (empty once materialized)."""
        return [m.range for m in self._maps.values()]

    def subpool_tensors(self, subpool: int, layer: int) -> dict[str, torch.Tensor]:
        """Subpool ``subpool``'s tensors of ``layer`` (views or private copies), ``LAYER_KEYS``;
        with ``split="experts"`` index 0 is its first expert (``subpool_experts``)."""
        self.info(layer)
        return dict(self._subpools[subpool].tensors[layer])

    def subpool_experts(self, subpool: int, layer: int) -> range:
        """The experts of ``layer`` that subpool ``subpool`` computes (all for split="inter")."""
        e = self.info(layer).num_experts
        if self._split == "inter":
            return range(e)
        return range(*_expert_block(e, subpool, self.num_subpools))

    def nbytes(self) -> int:
        """Bytes of expert weights the pool serves (each subpool's share counted once)."""
        return sum(sp.nbytes() for sp in self._subpools)

    # -------------------------------------------------------------------- compute
    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t])``: x [T, H] → [T, H];
        ``limit``: the SwiGLU clip (``runtime/forward/moe.py`` ``swiglu``; DeepSeek-V4)."""
        info = self._check_x(layer, x, "forward")
        routing = _route(info, layer, x, topk_ids, topk_weights)
        return self._run(layer, x.to(torch.float32).contiguous(), routing, limit).to(x.dtype)

    def expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` of ``layer`` on ``x`` [..., H] → [..., H] (x's dtype)."""
        info = self._check_x(layer, x, "expert")
        if not 0 <= e < info.num_experts:
            raise HetquantError(f"expert: expert {e} not in 0..{info.num_experts - 1}")
        x32 = x.reshape(-1, info.hidden).to(torch.float32).contiguous()
        n = x32.shape[0]
        one = torch.tensor([e] if n else [], dtype=torch.int64)
        r = Routing(one, torch.tensor([0, n] if n else [0]), torch.arange(n), torch.ones(n))
        return self._run(layer, x32, r).reshape(x.shape).to(x.dtype)

    def _check_x(self, layer: int, x: torch.Tensor, what: str) -> ExpertLayerInfo:
        if self._closed:
            raise HetquantError(f"{what}: the pool is closed")
        info = self.info(layer)
        if x.dtype not in _FLOAT_IN:
            raise HetquantError(f"{what}: x must be float32, bfloat16 or float16, not {x.dtype}")
        if x.ndim < 1 or x.shape[-1] != info.hidden:
            raise HetquantError(
                f"{what}: x has shape {list(x.shape)}; layer {layer} has hidden {info.hidden}"
            )
        return info

    def _run(
        self, layer: int, x32: torch.Tensor, routing: Routing, limit: float | None = None
    ) -> torch.Tensor:
        kw = {"backend": self._backend, "threads": self._threads, "precision": self._precision}
        kw["fused"], kw["limit"] = self._fused and limit is None, limit  # fused MoE: no clip
        rows = self._infos[layer].fmt.subpool_down == "rows"
        if rows and self._split == "inter" and self.num_subpools > 1:
            return _run_rows(self._subpools, layer, x32, routing, kw)
        owned = lambda s: self.subpool_experts(s, layer)  # noqa: E731
        return _run_partials(self._subpools, layer, x32, routing, kw, owned)

    # -------------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the subpool threads and unmap the files (views handed out keep their map)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sp in self._subpools:
            sp.executor.shutdown(wait=True)
            sp.tensors.clear()
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __enter__(self) -> CpuExpertPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CpuExpertPool(layers={self.layers}, subpools={self.num_subpools}, "
            f"split={self._split!r}, materialized={self._materialized})"
        )
