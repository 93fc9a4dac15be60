"""``open_artifact``: an artifact's modules from its manifest, config, index and headers, and
``Artifact.load``: one rank's tensors, reading only the bytes it keeps.

Which format each stored module is in: ``hetquant.json`` ``module_formats`` (prefix →
``{"format": name, "params": {...}, "shape": [out, in]}``) when present, otherwise the module's
key set (``IDENTIFY``):

=================================================  ===============================================
keys                                               format (weight shape [out, in] from)
=================================================  ===============================================
qweight, qzeros, scales                            awq_w4a16, group = K / scales.shape[0]
weight_packed, weight_scale, weight_shape          ct_pack_quantized, group from weight_scale
weight_packed, weight_scale                        int4_cpu
weight, weight_scale, weight_offset (+ input_*,    w8a8_dynamic (w8a8 with the four static keys)
deq_scale, quant_bias)
weight, weight_scale, weight_scale_2 (+ input_     nvfp4, or nvfp4_ascend when config.json's
scale)                                             quantization_config says ``format: nvfp4_ascend``
weight, weight_scale_inv                           fp8_block
weight (2-D BF16) / anything else                  bf16 / a plain tensor, loaded as stored
=================================================  ===============================================

Every identified module is checked against ``fmt.stored(shape)``; keys outside the matched row
(``e_score_correction_bias``) are plain tensors of their own.

``plan`` is shape-only: for every kept tensor, the ``Span`` of file bytes its piece occupies (the
piece is a slice along one dim of the format's ``shard_view``); ``load`` reads them (_reader.py),
applies ``shard_fixup`` and the ``repack`` hook per module. ``bytes_read`` / ``last_load`` count
the tensor bytes read from files (headers not included).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import FORMATS, WeightFormat, get_format
from hetquant.formats.dtypes import itemsize, torch_dtype
from hetquant.formats.errors import HetquantError
from hetquant.formats.safetensors_io import HeaderEntry, read_header

from ._reader import LoadStats, Span, read_spans
from .layout import ParallelLayout, split_of
from .shard_rules import (
    ModelFacts,
    ModuleInfo,
    Piece,
    Placement,
    place,
    shard_pieces,
    split_range,
)

__all__ = ["IDENTIFY", "Artifact", "LoadStats", "Span", "TensorRead", "open_artifact"]

MANIFEST, INDEX = "hetquant.json", "model.safetensors.index.json"
Repack = Callable[[str, WeightFormat | None, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _q(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return cfg.get("quantization_config") or {}


_Infer = Callable[[Mapping[str, HeaderEntry], Mapping[str, Any]], tuple[WeightFormat, tuple]]
IDENTIFY: tuple[tuple[frozenset[str], _Infer], ...] = tuple((frozenset(k.split()), f) for k, f in (
    ("qweight qzeros scales", lambda m, c: (get_format(
        "awq_w4a16", group_size=m["qweight"].shape[0] // m["scales"].shape[0]),
        (m["scales"].shape[1], m["qweight"].shape[0]))),
    ("weight_packed weight_scale weight_shape", lambda m, c: (get_format(
        "ct_pack_quantized", group_size=8 * m["weight_packed"].shape[1] // m["weight_scale"].shape[1],
        scale_dtype=m["weight_scale"].dtype, shape_dtype=m["weight_shape"].dtype),
        (m["weight_packed"].shape[0], 8 * m["weight_packed"].shape[1]))),
    ("weight_packed weight_scale", lambda m, c: (
        FORMATS["int4_cpu"], (m["weight_packed"].shape[0], 2 * m["weight_packed"].shape[1]))),
    ("weight weight_scale weight_offset input_scale input_offset deq_scale quant_bias",
     lambda m, c: (FORMATS["w8a8"], m["weight"].shape)),
    ("weight weight_scale weight_offset", lambda m, c: (FORMATS["w8a8_dynamic"], m["weight"].shape)),
    ("weight weight_scale weight_scale_2 input_scale", lambda m, c: _fp4(m, c, True)),
    ("weight weight_scale weight_scale_2", lambda m, c: _fp4(m, c, False)),
    ("weight weight_scale_inv", lambda m, c: (FORMATS["fp8_block"], m["weight"].shape)),
    ("weight", lambda m, c: (FORMATS["bf16"], m["weight"].shape)),
))  # fmt: skip


def _fp4(m: Mapping[str, HeaderEntry], cfg: Mapping[str, Any], inp: bool) -> tuple:
    w = m["weight"].shape
    if _q(cfg).get("format") == "nvfp4_ascend":  # tiled: weight [K, N/2]
        return get_format("nvfp4_ascend", with_input_scale=inp), (2 * w[1], w[0])
    return get_format("nvfp4", with_input_scale=inp), (w[0], 2 * w[1])


def _identify(prefix: str, metas: dict[str, HeaderEntry], cfg: Mapping[str, Any], named: Any):
    """(format or None, weight shape, keys it covers) of one module's stored tensors.

    ``named``: the manifest's ``{"format", "params", "shape"}`` for this module, if any.
    """
    if named is not None:
        return _checked(prefix, metas, lambda: _named(named))
    for keys, infer in IDENTIFY:
        if not keys <= metas.keys():
            continue
        w = metas.get("weight")
        if keys == {"weight"} and (w.dtype != "BF16" or len(w.shape) != 2):
            return None, w.shape, keys  # a norm, a bias, an F32 copy: plain
        return _checked(prefix, metas, lambda infer=infer: infer(metas, cfg))
    return None, (), frozenset()


def _named(named: Mapping[str, Any]) -> tuple[WeightFormat, tuple[int, ...]]:
    return get_format(named["format"], **named.get("params", {})), tuple(named["shape"])


def _checked(prefix: str, metas: Mapping[str, HeaderEntry], infer: Callable[[], tuple]):
    try:
        fmt, shape = infer()
        want = fmt.stored(tuple(shape))
    except (HetquantError, ZeroDivisionError, IndexError, KeyError, TypeError) as e:
        raise HetquantError(
            f"{prefix}: stored tensors {sorted(metas)} fit no format: {e}"
        ) from None
    got = {k: metas[k].meta for k in want if k in metas}
    if got != want:
        raise HetquantError(
            f"{prefix}: stored as {fmt.name} for weight {list(shape)}, but the tensors are "
            f"{_show(got)}; {fmt.name} stores {_show(want)}"
        )
    return fmt, tuple(shape), frozenset(want)


def _show(metas: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}: {m.dtype}{list(m.shape)}" for k, m in sorted(metas.items()))


@dataclass(frozen=True)
class TensorRead:
    """One stored tensor of this rank: where its bytes are and what they become."""

    name: str
    module: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    span: Span
    bounds: tuple[tuple[int, int], tuple[int, int]] | None  # (out, in) ranges when split

    @property
    def nbytes(self) -> int:
        return self.span.nbytes


def _span(entry: HeaderEntry, piece: Piece) -> Span:
    if piece.axis is None:
        return Span(entry.start, entry.nbytes, entry.nbytes)
    v, a = piece.view, piece.axis
    inner = math.prod(v[a + 1 :]) * itemsize(entry.dtype)  # bytes per entry along the axis
    run, stride, outer = (piece.stop - piece.start) * inner, v[a] * inner, math.prod(v[:a])
    start = entry.start + piece.start * inner
    if outer == 1 or run == stride:
        return Span(start, run * outer, run * outer)
    return Span(start, run, stride, outer)


@dataclass
class Artifact:
    """An opened artifact (headers only; see ``open_artifact``)."""

    root: Path
    manifest: dict[str, Any]
    config: dict[str, Any]
    modules: dict[str, ModuleInfo]  # module id (prefix, or prefix.key for extras) → info
    bytes_read: int = 0
    last_load: LoadStats | None = None
    facts: ModelFacts = field(init=False)
    placements: dict[str, Placement] = field(init=False)  # module id → role (shard_rules)

    def __post_init__(self) -> None:
        self.facts = ModelFacts.from_config(self.config)
        self.placements = {mid: place(info.prefix) for mid, info in self.modules.items()}

    @property
    def cpu_expert_files(self) -> dict[int, Path]:
        """MoE layer → its ``cpu_experts/layer_XXX.safetensors`` (for the CPU expert pool)."""
        files = self.manifest.get("parts", {}).get("cpu_experts", {}).get("files", [])
        return {int(Path(f).stem.split("_")[-1]): self.root / f for f in files}

    def cpu_expert_pool(self, subpools: int = 1, **options: Any) -> Any:
        """The ``cpu_experts/`` part as a ``CpuExpertPool`` (runtime/expert_pool.py); ``load``
        never reads those files."""
        from .expert_pool import CpuExpertPool  # lazily: only artifacts with a pool need it

        return CpuExpertPool.open(self.root, subpools, **options)

    def plan(self, layout: ParallelLayout, *, mtp: bool = False) -> list[TensorRead]:
        """This rank's reads, shape-only, in file order; ``mtp`` adds the MTP layers (last stage)."""
        layout.validate(self.config, self.modules)
        self._check_accel(layout)
        reads = []
        for mid, info in self.modules.items():
            pl = self.placements[mid]
            if not self._keeps(pl, layout, mtp):
                continue
            dim = split_of(pl, layout)
            bounds, pieces = None, shard_pieces(info, None, 0, 0)
            if dim is not None:
                rng = split_range(pl, info.shape[dim], layout.tp_size, layout.tp_rank)
                pieces = shard_pieces(info, dim, *rng)
                bounds = (rng, (0, info.shape[1])) if dim == 0 else ((0, info.shape[0]), rng)
            for key, piece in pieces.items():
                file, entry = info.entries[key]
                span = _span(entry, piece)
                reads.append(
                    TensorRead(entry.name, mid, file, entry.dtype, piece.shape, span, bounds)
                )
        return sorted(reads, key=lambda r: (r.file, r.span.start))

    def _keeps(self, pl: Placement, layout: ParallelLayout, mtp: bool) -> bool:
        f, g = self.facts, pl.rule.group
        if g == "cpu":
            return False
        if pl.layer is None:
            return layout.is_first_stage if g == "embed" else layout.is_last_stage
        if pl.layer >= f.num_layers:
            if not (mtp and layout.is_last_stage):
                return False
        elif pl.layer not in layout.stage_layers(f.num_layers):
            return False
        if g != "routed":
            return True
        ids = layout.accel_ids(pl.layer, f.n_routed)
        if ids is not None and pl.expert not in ids:
            return False
        if pl.layer not in f.moe_layers:
            raise HetquantError(f"config.json makes layer {pl.layer} dense, but it stores experts")
        return pl.expert in layout.owned_experts(f.moe_layers.index(pl.layer), f.n_routed)

    def _check_accel(self, layout: ParallelLayout) -> None:
        """Refuse ``accel_experts`` that asks for routed experts the root part does not store."""
        f = self.facts
        stored = {pl.layer for pl in self.placements.values() if pl.rule.group == "routed"}
        for layer in set(layout.stage_layers(f.num_layers)) & set(f.moe_layers) - stored:
            if want := layout.accel_ids(layer, f.n_routed):
                raise HetquantError(
                    f"accel_experts puts experts {sorted(want)[:8]} of layer {layer} on the "
                    "accelerator, but the artifact's root part stores no routed experts of that "
                    "layer (the CPU expert pool has them: cpu_experts/); use accel_experts=0"
                )

    def load(
        self,
        layout: ParallelLayout,
        device: str | torch.device = "cpu",
        *,
        repack: Repack | None = None,
        mtp: bool = False,
        copy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """This rank's tensors under their stored names, sliced per the shard rules.

        ``repack(prefix, fmt, {key: tensor})`` (fmt None for a plain tensor) runs per module
        after the tensors reach ``device`` and returns the backend's tensors (local keys).
        On the CPU, tensors that are whole byte ranges of a file are views of its private memory
        map with their pages read in (``_reader``); ``copy=True`` gives every tensor its own
        memory instead (for files that may be rewritten while the tensors live).
        """
        reads, stats = self.plan(layout, mtp=mtp), LoadStats()
        target = torch.device(device)
        items = [(r.name, r.file, r.span) for r in reads]
        flat = read_spans(self.root, items, target, stats, copy=copy)
        out: dict[str, torch.Tensor] = {}
        for r in reads:
            out[r.name] = flat.pop(r.name).view(torch_dtype(r.dtype)).reshape(r.shape)
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        _finish_modules(self.modules, reads, out, repack)
        self.last_load = stats
        self.bytes_read += stats.bytes_read
        return out


def _finish_modules(
    modules: dict[str, ModuleInfo], reads: list[TensorRead], out: dict, repack: Repack | None
) -> None:
    by_module: dict[str, list[TensorRead]] = {}
    for r in reads:
        by_module.setdefault(r.module, []).append(r)
    for mid, rs in by_module.items():
        info = modules[mid]
        local = {r.name[len(info.prefix) + 1 :]: out.pop(r.name) for r in rs}
        if rs[0].bounds is not None and info.fmt is not None:
            local = info.fmt.shard_fixup(local, *rs[0].bounds)
        if repack is not None:
            local = repack(info.prefix, info.fmt, local)
        out.update({f"{info.prefix}.{k}": t for k, t in local.items()})


def open_artifact(path: str | os.PathLike[str]) -> Artifact:
    """Open the artifact at ``path``: manifest, config.json, index and headers; no tensor data."""
    root = Path(path)
    manifest, config = _json(root / MANIFEST), _json(root / "config.json")
    if manifest.get("complete") is not True:
        raise HetquantError(
            f"{root}: {MANIFEST} is not marked complete; the conversion did not finish"
        )
    weight_map = _json(root / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HetquantError(f"{root / INDEX}: no weight_map; re-run the conversion")
    headers = {}
    for file in sorted(set(weight_map.values())):
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise HetquantError(f"{root / INDEX}: unsafe shard path {file!r}")
        headers[file] = read_header(root / file).entries
    grouped: dict[str, dict[str, tuple[str, HeaderEntry]]] = {}
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise HetquantError(f"{root / INDEX}: {name} is not in {file}; the index is corrupt")
        prefix, _, key = name.rpartition(".")
        grouped.setdefault(prefix, {})[key] = (file, headers[file][name])
    named = manifest.get("module_formats") or {}
    modules = {}
    for prefix, entries in grouped.items():
        metas = {k: e for k, (_, e) in entries.items()}
        fmt, shape, keys = _identify(prefix, metas, config, named.get(prefix))
        if keys:
            modules[prefix] = ModuleInfo(prefix, fmt, shape, {k: entries[k] for k in keys})
        extras = sorted(entries.keys() - keys)  # plain tensors of their own
        for key in extras:
            mid = prefix if not keys and len(extras) == 1 else f"{prefix}.{key}"
            modules[mid] = ModuleInfo(prefix, None, entries[key][1].shape, {key: entries[key]})
    order = sorted(modules, key=lambda m: min((f, e.start) for f, e in modules[m].entries.values()))
    return Artifact(root, manifest, config, {m: modules[m] for m in order})


def _json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HetquantError(f"{path}: missing; not a (complete) hetquant artifact") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HetquantError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise HetquantError(f"{path}: not a JSON object")
    return doc
