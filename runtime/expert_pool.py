"""CPU expert pool: the routed experts of a hybrid artifact, memory-mapped and served by subpools.

``ascend-hybrid`` artifacts keep every routed MoE expert in ``cpu_experts/layer_XXX.safetensors``
in the ``int4_cpu`` layer layout (``formats/int4_cpu.py``). :class:`CpuExpertPool` opens them
from the manifest (``hetquant.json`` → ``parts.cpu_experts.files``) and the safetensors headers
— nothing from ``hetquant.convert`` — and computes the routed-expert sum of a layer::

    pool = CpuExpertPool.open("OUTPUT", subpools=2)          # split="inter" (default)
    y = pool.forward(layer, x, topk_ids, topk_weights)        # Σ_k w_k · expert_{id_k}(x), [T, H]
    y_e = pool.expert(layer, e, x)                            # one expert, x [..., H]

``forward`` has the signature of ``runtime.model.Weights.experts``, so a weights provider can
hand its routed experts to the pool.

Memory. Every layer file is mapped whole with a private copy-on-write ``mmap`` (the file is never
written; pages are page cache shared with other processes) and every tensor is a zero-copy view
of that one mapping (``mapped_ranges`` gives the address ranges). Nothing is read at open except
the headers and the pages each subpool touches.

Subpools (kt-kernel's NUMA thread pools, reference/cpu_experts.md §1.3). ``subpools=S`` with

- ``split="inter"`` (default): subpool ``s`` owns the intermediate slice ``[s·I/S, (s+1)·I/S)``
  of every expert, as views from :func:`~hetquant.formats.int4_cpu.subpool_slice` (no
  requantization: the down scale covers the whole row, so the partial sums add up exactly in
  real arithmetic). Needs ``I % S == 0`` and ``I/S`` even. Every subpool works on every token.
- ``split="experts"``: subpool ``s`` owns the whole experts ``[⌊s·E/S⌋, ⌊(s+1)·E/S⌋)``
  (contiguous blocks; ``1 ≤ S ≤ E``). A token only reaches the subpools of its experts.

Each subpool has its own worker thread (one ``ThreadPoolExecutor`` of one thread); that thread
prepares the subpool's share at open and computes its partial sums in ``forward``, which the
caller adds up in subpool order (so results are deterministic). At open, the thread either
*touches* one byte per page of its views (``materialize=False``: faults the mapping in from that
thread) or, with ``materialize=True``, copies its share into private memory that it allocates and
writes itself (first touch), after which the files are unmapped. The native GEMV kernel's own
worker threads are started by the subpool thread, so they inherit its CPU affinity.

NUMA placement. Linux places a private page on the node of the CPU that first writes it, so a
NUMA deployment passes ``cpus``: one CPU set per subpool, e.g. for two sockets of 64 cores
``cpus=[range(0, 64), range(64, 128)]`` (``lscpu -p=CPU,NODE`` or
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
team whose barrier spinning competes with the kernel (see ``_init_worker``). ``threads=`` sets
the native kernel's threads per subpool call.

Numerics. Activations are computed in float32 whatever ``x``'s dtype (float32, bfloat16 or
float16) and the result is cast back to it. The GEMVs are those of
:mod:`hetquant.runtime.int4_gemv` (native kernel up to ``MAX_NATIVE_TOKENS`` tokens per expert,
else the torch path; ``backend=`` forces one; ``precision="fast"`` rounds activations to 14-bit
instead of 22-bit fixed point). Routing weights are cast to ``x``'s dtype first, as
``runtime.moe.routed_experts`` (and DeepSeek's reference) does. The loader's
``open_artifact(dir).cpu_expert_pool(subpools, **options)`` (DESIGN.md) calls
``CpuExpertPool.open``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.dtypes import itemsize, torch_dtype
from hetquant.formats.int4_cpu import LAYER_KEYS, layer_stored, subpool_slice
from hetquant.formats.safetensors_io import HeaderEntry, read_header

from .int4_gemv import BACKENDS, PRECISIONS, int4_gemv

__all__ = ["CpuExpertPool", "ExpertLayerInfo"]

MANIFEST = "hetquant.json"
SPLITS = ("inter", "experts")
_PAGE = mmap.PAGESIZE
_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")
_FLOAT_IN = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ExpertLayerInfo:
    """One MoE layer of the pool: where it lives and its dims (E experts, hidden H, inter I)."""

    layer: int
    path: Path
    prefix: str  # tensor-name prefix, e.g. "model.layers.3.mlp.experts"
    num_experts: int
    hidden: int
    inter: int
    entries: dict[str, HeaderEntry]  # LAYER_KEYS → header entry


# ------------------------------------------------------------------------------------------------
# manifest and headers


def _cpu_expert_files(artifact: Path) -> list[Path]:
    man = artifact / MANIFEST
    if not man.is_file():
        raise HetquantError(
            f"{artifact}: no {MANIFEST}; not a hetquant artifact, or its conversion did not finish"
        )
    try:
        doc = json.loads(man.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HetquantError(f"{man}: not valid JSON ({e}); re-run the conversion") from None
    if not isinstance(doc, dict) or doc.get("complete") is not True:
        raise HetquantError(f"{man}: the artifact is not complete; re-run the conversion")
    parts = doc.get("parts")
    part = parts.get("cpu_experts") if isinstance(parts, dict) else None
    files = part.get("files") if isinstance(part, dict) else None
    if not files:
        recipe = (doc.get("recipe") or {}).get("name", "?")
        raise HetquantError(
            f"{artifact}: the artifact (recipe {recipe}) has no cpu_experts part; convert with "
            "--recipe ascend-hybrid to get CPU experts"
        )
    root = artifact.resolve()
    out = []
    for rel in files:
        if not isinstance(rel, str):
            raise HetquantError(f"{man}: parts.cpu_experts.files holds a non-string {rel!r}")
        p = (artifact / rel).resolve()
        if not p.is_relative_to(root):
            raise HetquantError(f"{man}: cpu_experts file {rel!r} points outside the artifact")
        if not p.is_file():
            raise HetquantError(f"{artifact}: cpu_experts file {rel} is missing; re-download it")
        out.append(p)
    return out


def _layers_of(path: Path) -> list[ExpertLayerInfo]:
    header = read_header(path)
    groups: dict[str, dict[str, HeaderEntry]] = {}
    for name, entry in header.entries.items():
        prefix, _, key = name.rpartition(".")
        if key in LAYER_KEYS:
            groups.setdefault(prefix, {})[key] = entry
    if not groups:
        raise HetquantError(f"{path}: no int4_cpu expert tensors ({', '.join(LAYER_KEYS)})")
    out = []
    for prefix, entries in groups.items():
        m = _PREFIX.search(prefix)
        if m is None:
            raise HetquantError(f"{path}: cannot read a layer number from tensor prefix {prefix!r}")
        missing = [k for k in LAYER_KEYS if k not in entries]
        if missing:
            raise HetquantError(f"{path}: {prefix} lacks {', '.join(missing)}")
        gu = entries["gate_up_packed"]
        down = entries["down_packed"]
        if len(gu.shape) != 3 or len(down.shape) != 3:
            raise HetquantError(f"{path}: {prefix}: packed tensors must be 3-D")
        dims = (gu.shape[0], 2 * gu.shape[2], 2 * down.shape[2])
        want = layer_stored(*dims)
        for key, meta in want.items():
            if entries[key].meta != meta:
                raise HetquantError(
                    f"{path}: {prefix}.{key} is {entries[key].meta}, expected {meta}"
                )
        out.append(ExpertLayerInfo(int(m.group(1)), path, prefix, *dims, entries))
    return out


# ------------------------------------------------------------------------------------------------
# the mapping


class _Mapping:
    """One file, mapped whole (private, copy-on-write); views are slices of one uint8 tensor."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.base: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.range = (self.base.data_ptr(), self.base.data_ptr() + len(self.mm))
        self.path = path

    def view(self, entry: HeaderEntry) -> torch.Tensor:
        assert self.base is not None
        raw = self.base[entry.start : entry.end]
        if entry.start % itemsize(entry.dtype):  # safetensors does not promise alignment
            raw = raw.clone()
        return raw.view(torch_dtype(entry.dtype)).reshape(entry.shape)

    def close(self) -> None:
        self.base = None
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view: the map goes when the view does
            pass


# ------------------------------------------------------------------------------------------------
# subpools


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


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy allocated and written by the calling thread (first touch)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    if t.numel():
        # numpy's copy runs in this thread (torch's copy_ may hand it to its OpenMP workers).
        np.copyto(out.view(torch.uint8).numpy(), t.view(torch.uint8).numpy())
    return out


class _Subpool:
    def __init__(self, index: int, cpus: frozenset[int] | None) -> None:
        self.index = index
        self.cpus = cpus
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"hetquant-subpool{index}",
            initializer=_init_worker,
            initargs=(cpus,),
        )

    def submit(self, fn, *args) -> Future:
        return self.executor.submit(fn, *args)


# ------------------------------------------------------------------------------------------------
# the pool


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
    ) -> CpuExpertPool:
        """Open the ``cpu_experts`` part of ``artifact_dir``.

        ``layers``: the MoE layer numbers to load (default: all in the manifest).
        ``materialize``: copy each subpool's share into private memory (module docstring).
        ``cpus``: one CPU set per subpool; each subpool thread pins itself to its set.
        ``threads``: native-kernel threads per subpool call (default
        ``max(1, torch.get_num_threads() // subpools)``). ``backend``, ``precision``: passed to
        ``int4_gemv`` (``precision="fast"`` rounds activations to 14-bit instead of 22-bit fixed
        point, for about a third fewer dot-products).
        """
        if isinstance(subpools, bool) or not isinstance(subpools, int) or subpools < 1:
            raise HetquantError(f"CpuExpertPool: subpools = {subpools!r}; need an integer >= 1")
        if split not in SPLITS:
            raise HetquantError(f"CpuExpertPool: split {split!r} not in {SPLITS}")
        if backend not in BACKENDS:
            raise HetquantError(f"CpuExpertPool: backend {backend!r} not in {BACKENDS}")
        if precision not in PRECISIONS:
            raise HetquantError(
                f"CpuExpertPool: precision {precision!r} not in {tuple(PRECISIONS)}"
            )
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
        artifact = Path(artifact_dir)
        infos: dict[int, ExpertLayerInfo] = {}
        for path in _cpu_expert_files(artifact):
            for info in _layers_of(path):
                if info.layer in infos:
                    raise HetquantError(
                        f"{artifact}: layer {info.layer} appears in {infos[info.layer].path.name} "
                        f"and {path.name}"
                    )
                infos[info.layer] = info
        if layers is not None:
            want = sorted({int(v) for v in layers})
            absent = [v for v in want if v not in infos]
            if absent:
                raise HetquantError(
                    f"{artifact}: no CPU experts for layer(s) {absent}; the artifact has "
                    f"{sorted(infos)}"
                )
            infos = {v: infos[v] for v in want}
        if not infos:
            raise HetquantError(f"{artifact}: no layers selected")
        _check_split(infos, subpools, split)

        pool = cls()
        pool._infos = dict(sorted(infos.items()))
        pool._split = split
        pool._materialized = materialize
        pool._backend = backend
        pool._precision = precision
        pool._threads = (
            int(threads) if threads is not None else max(1, torch.get_num_threads() // subpools)
        )
        try:
            for info in pool._infos.values():
                if info.path not in pool._maps:
                    pool._maps[info.path] = _Mapping(info.path)
            pool._subpools = [_Subpool(s, cpu_sets[s]) for s in range(subpools)]
            futures = [sp.submit(pool._prepare, sp) for sp in pool._subpools]
            for f in futures:
                f.result()
            if materialize:
                for m in pool._maps.values():
                    m.close()
                pool._maps.clear()
        except BaseException:
            pool.close()
            raise
        return pool

    def _layer_views(self, info: ExpertLayerInfo) -> dict[str, torch.Tensor]:
        m = self._maps[info.path]
        return {k: m.view(info.entries[k]) for k in LAYER_KEYS}

    def _prepare(self, sp: _Subpool) -> None:
        """Runs in subpool ``sp``'s thread: take its views, then touch or copy them."""
        n = len(self._subpools)
        for layer, info in self._infos.items():
            full = self._layer_views(info)
            if self._split == "inter":
                views = subpool_slice(full, sp.index, n)
            else:
                a, b = _expert_block(info.num_experts, sp.index, n)
                views = {k: v[a:b] for k, v in full.items()}
            if self._materialized:
                views = {k: _private_copy(v) for k, v in views.items()}
            else:
                for v in views.values():
                    _touch(v)
            sp.tensors[layer] = views

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
        total = 0
        for sp in self._subpools:
            for views in sp.tensors.values():
                total += sum(v.numel() * v.element_size() for v in views.values())
        return total

    # -------------------------------------------------------------------- compute
    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """``Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t])``: x [T, H] → [T, H]."""
        info = self._check_x(layer, x, "forward")
        if x.ndim != 2:
            raise HetquantError(f"forward: x must be [T, H], got {list(x.shape)}")
        t = x.shape[0]
        if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
            raise HetquantError(
                f"forward: topk_ids {list(topk_ids.shape)} and topk_weights "
                f"{list(topk_weights.shape)} must both be [T={t}, k]"
            )
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise HetquantError(f"forward: topk_ids must be integers, got {topk_ids.dtype}")
        if topk_ids.numel() and (
            int(topk_ids.min()) < 0 or int(topk_ids.max()) >= info.num_experts
        ):
            raise HetquantError(
                f"forward: topk_ids outside 0..{info.num_experts - 1} (layer {layer})"
            )
        x32 = x.to(torch.float32).contiguous()
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
        w_all = topk_weights.to(x.dtype).to(torch.float32).reshape(-1)[order]
        tok_all = order // k
        groups: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        start = 0
        for e, c in zip(ids.tolist(), counts.tolist(), strict=True):
            groups.append((e, tok_all[start : start + c], w_all[start : start + c]))
            start += c
        out = self._run(layer, x32, groups)
        return out.to(x.dtype)

    def expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` of ``layer`` on ``x`` [..., H] → [..., H] (x's dtype)."""
        info = self._check_x(layer, x, "expert")
        if not 0 <= e < info.num_experts:
            raise HetquantError(f"expert: expert {e} not in 0..{info.num_experts - 1}")
        x32 = x.reshape(-1, info.hidden).to(torch.float32).contiguous()
        n = x32.shape[0]
        groups = [(e, torch.arange(n), torch.ones(n))] if n else []
        return self._run(layer, x32, groups).reshape(x.shape).to(x.dtype)

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
        self, layer: int, x32: torch.Tensor, groups: list[tuple[int, torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        futures = []
        for sp in self._subpools:
            owned = self.subpool_experts(sp.index, layer)
            mine = [g for g in groups if g[0] in owned]
            if mine:
                futures.append(sp.submit(self._partial, sp, layer, x32, mine))
        out: torch.Tensor | None = None
        for f in futures:  # subpool order: the sum is deterministic
            part = f.result()
            out = part if out is None else out.add_(part)
        return out if out is not None else torch.zeros_like(x32)

    def _partial(
        self,
        sp: _Subpool,
        layer: int,
        x32: torch.Tensor,
        groups: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Runs in ``sp``'s thread: this subpool's share of the expert sum, float32 [T, H]."""
        t = sp.tensors[layer]
        e0 = self.subpool_experts(sp.index, layer).start
        out = torch.zeros_like(x32)
        kw = {"backend": self._backend, "threads": self._threads, "precision": self._precision}
        for e, tok, w in groups:
            i = e - e0
            xs = x32.index_select(0, tok)  # [n, H]
            gu = int4_gemv(t["gate_up_packed"][i], t["gate_up_scale"][i], xs, **kw)  # [n, 2I/S]
            act = F.silu(gu[:, 0::2]) * gu[:, 1::2]  # [n, I/S]
            y = int4_gemv(t["down_packed"][i], t["down_scale"][i], act, **kw)  # [n, H]
            out.index_add_(0, tok, y * w[:, None])
        return out

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


def _expert_block(num_experts: int, s: int, n: int) -> tuple[int, int]:
    return s * num_experts // n, (s + 1) * num_experts // n


def _check_split(infos: dict[int, ExpertLayerInfo], subpools: int, split: str) -> None:
    for info in infos.values():
        if split == "inter":
            i = info.inter
            if i % subpools or (i // subpools) % 2:
                raise HetquantError(
                    f"CpuExpertPool: {subpools} subpools cannot split moe intermediate {i} "
                    f"(layer {info.layer}); need I % S == 0 and I/S even — e.g. S in "
                    f"{[s for s in range(1, min(i, 64) + 1) if i % s == 0 and (i // s) % 2 == 0]}"
                    ", or split='experts'"
                )
        elif subpools > info.num_experts:
            raise HetquantError(
                f"CpuExpertPool: {subpools} subpools for {info.num_experts} experts (layer "
                f"{info.layer}); split='experts' needs at most one subpool per expert"
            )
