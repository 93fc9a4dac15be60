"""``open_artifact``: an artifact's modules from its manifest, config, index and headers, and
``Artifact.load``: one rank's tensors, reading only the bytes it keeps.

Which format each stored module is in: ``hetquant.json`` ``module_formats`` (prefix →
``{"format": name, "params": {...}, "shape": [out, in]}``, schema 2) for artifacts hetquant
wrote; otherwise (schema-1 manifests, checkpoints hetquant did not write) the module's stored
tensors are recognised by ``hetquant.formats.identify`` — each format's own inverse of
``stored`` — and a lone ``weight`` no format claims (a norm, an F32 copy) is a plain tensor.

Every module is checked against ``fmt.stored(shape)``; keys the format does not own
(``e_score_correction_bias``) are plain tensors of their own.

config.json is parsed once, here; the stored modules are placed once, by the artifact's
``ModelPlacement`` (``runtime/parallel/placement.py``), whose ``reads(layout)`` says which byte
spans this rank keeps. ``plan`` is that list; ``load`` reads exactly those spans (_reader.py),
then applies ``shard_fixup`` and the ``repack`` hook per module. ``bytes_read`` / ``last_load``
count the tensor bytes read from files (headers not included).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import WeightFormat, get_format
from hetquant.formats.dtypes import torch_dtype
from hetquant.formats.errors import HetquantError
from hetquant.formats.families import ModelConfig, parse_config
from hetquant.formats.filenames import INDEX_NAME, MANIFEST_NAME
from hetquant.formats.identify import identify
from hetquant.formats.json_io import load_json, parse_json
from hetquant.formats.manifest_schema import check_manifest
from hetquant.formats.safe_paths import inside
from hetquant.formats.safetensors_io import HeaderEntry, read_header

from ..experts._expert_files import _select_layers
from ..parallel.layout import ParallelLayout
from ..parallel.pieces import ModuleInfo, Span, TensorRead
from ..parallel.placement import ModelPlacement
from ._pin import ManifestPin, Replaced, open_pinned
from ._reader import LoadStats, read_spans
from .conformance import check_conforms

__all__ = ["Artifact", "LoadStats", "Span", "TensorRead", "open_artifact"]

MANIFEST, INDEX = MANIFEST_NAME, INDEX_NAME
_SINCE = "since it was opened"
Repack = Callable[[str, WeightFormat | None, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _identify(prefix: str, metas: dict[str, HeaderEntry], named: Any, trusted: bool):
    """(format or None, weight shape, keys it covers) of one module's stored tensors.

    ``named``: the manifest's ``{"format", "params", "shape"}`` for this module, if any;
    ``trusted``: the manifest lists every module's format, so one it does not name is plain.
    """
    if named is not None:
        return _checked(prefix, metas, lambda: _named(named))
    got = None if trusted else identify({k: e.meta for k, e in metas.items()}, name=prefix)
    if got is not None:
        return got.fmt, got.shape, got.keys
    if "weight" in metas:  # a norm, a bias, an F32 copy: plain
        return None, metas["weight"].shape, frozenset({"weight"})
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


@dataclass
class Artifact:
    """An opened artifact (headers only; see ``open_artifact``)."""

    root: Path
    manifest: dict[str, Any]
    config: dict[str, Any]  # config.json as stored
    placement: ModelPlacement = field(repr=False)  # the parsed config and every module, placed
    bytes_read: int = 0
    last_load: LoadStats | None = None
    pin: ManifestPin | None = field(default=None, repr=False)  # the manifest it was opened with

    @property
    def cfg(self) -> ModelConfig:
        """config.json, parsed (once, by ``open_artifact``)."""
        return self.placement.cfg

    @property
    def modules(self) -> Mapping[str, ModuleInfo]:
        """Module id (prefix, or prefix.key for extras) → its stored tensors, in file order."""
        return self.placement.modules

    @property
    def generation(self) -> tuple[int, int] | None:
        """(device, inode) of the manifest it was opened with: which artifact, while it is open."""
        return self.pin.generation if self.pin is not None else None

    def _check(self) -> None:
        if self.pin is not None:
            self.pin.check(_SINCE)

    def _explaining(self) -> contextlib.AbstractContextManager[None]:
        return self.pin.explaining(_SINCE) if self.pin is not None else contextlib.nullcontext()

    @property
    def cpu_expert_files(self) -> dict[int, Path]:
        """MoE layer → its ``cpu_experts/layer_XXX.safetensors`` (for the CPU expert pool)."""
        files = self.manifest.get("parts", {}).get("cpu_experts", {}).get("files", [])
        paths = [inside(self.root, f, self.root / MANIFEST, "cpu_experts file") for f in files]
        layers = [p.stem.rpartition("_")[2] for p in paths]  # layer_XXX.safetensors
        if bad := [
            str(p) for p, n in zip(paths, layers, strict=True) if not (n.isascii() and n.isdigit())
        ]:
            raise HetquantError(f"{self.root / MANIFEST}: cpu_experts file {bad[0]} is not named layer_<number>.safetensors; re-run the conversion")  # fmt: skip
        return {int(n): p for n, p in zip(layers, paths, strict=True)}

    def cpu_expert_pool(self, subpools: int = 1, **options: Any) -> Any:
        """The ``cpu_experts/`` part as a ``CpuExpertPool`` (runtime/experts/expert_pool.py); ``load``
        never reads those files."""
        from ..experts.expert_pool import (
            CpuExpertPool,  # lazily: only artifacts with a pool need it
        )

        with self._explaining():
            pool = CpuExpertPool.open(self.root, subpools, **options)
        try:
            self._check()  # its files were opened after this artifact's: the same ones?
        except HetquantError:
            pool.close()
            raise
        return pool

    def check(self, layout: ParallelLayout) -> None:
        """Refuse ``layout`` for this artifact, naming the valid sizes (``ModelPlacement.check``)."""
        self.placement.check(layout)

    def plan(self, layout: ParallelLayout, *, mtp: bool = False) -> list[TensorRead]:
        """This rank's reads, shape-only, in file order; ``mtp`` adds the MTP layers (last stage)."""
        return self.placement.reads(layout, mtp=mtp)

    def load(
        self,
        layout: ParallelLayout,
        device: str | torch.device = "cpu",
        *,
        repack: Repack | None = None,
        mtp: bool = False,
        copy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """This rank's tensors under their stored names, sliced as the placement says.

        ``repack(prefix, fmt, {key: tensor})`` (fmt None for a plain tensor) runs per module
        after the tensors reach ``device`` and returns the backend's tensors (local keys).
        On the CPU, tensors that are whole byte ranges of a file are views of its private memory
        map with their pages read in (``_reader``); ``copy=True`` gives every tensor its own
        memory instead (for files that may be rewritten while the tensors live).
        """
        reads, stats = self.plan(layout, mtp=mtp), LoadStats()
        target = torch.device(device)
        items = [(r.name, r.file, r.span) for r in reads]
        with self._explaining():
            flat = read_spans(self.root, items, target, stats, copy=copy, opened=self._check)
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
    modules: Mapping[str, ModuleInfo], reads: list[TensorRead], out: dict, repack: Repack | None
) -> None:
    by_module: dict[str, list[TensorRead]] = {}
    for r in reads:
        by_module.setdefault(r.module, []).append(r)
    for mid, rs in by_module.items():
        info = modules[mid]
        cut = len(info.prefix) + 1 if info.prefix else 0  # a dotless name: no prefix
        local = {r.name[cut:]: out.pop(r.name) for r in rs}
        if rs[0].bounds is not None and info.fmt is not None:
            local = info.fmt.shard_fixup(local, *rs[0].bounds)
        if repack is not None:
            local = repack(info.prefix, info.fmt, local)
        out.update({_join(info.prefix, k): t for k, t in local.items()})


def _join(prefix: str, key: str) -> str:
    """A stored name from its module prefix and local key (DeepSeek-V4's ``hc_head_fn``: none)."""
    return f"{prefix}.{key}" if prefix else key


def open_artifact(
    path: str | os.PathLike[str], *, generation: tuple[int, int] | None = None
) -> Artifact:
    """Open the artifact at ``path``: manifest, config.json, index and headers; no tensor data.

    Refuses an artifact whose stored tensors (root shards and ``cpu_experts/``) are not the ones
    its config.json implies, shape for shape (``conformance``). All of one artifact (``_pin``):
    tried again if a convert replaced it meanwhile. ``generation``: refuse any other than that
    ``Artifact.generation`` (the ranks of a run).
    """
    root = Path(path)
    art = open_pinned(root, lambda pin: _open(root, pin))
    if generation is not None and art.generation != tuple(generation):
        raise Replaced(f"{root}: the artifact was replaced since the run checked it; run again")
    return art


def _open(root: Path, pin: ManifestPin) -> Artifact:
    manifest = parse_json(pin.read(), str(root / MANIFEST))
    check_manifest(manifest, str(root / MANIFEST))
    config = _json(root / "config.json")
    if manifest.get("complete") is not True:
        raise HetquantError(
            f"{root}: {MANIFEST} is not marked complete; the conversion did not finish"
        )
    weight_map = _json(root / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HetquantError(f"{root / INDEX}: no weight_map; re-run the conversion")
    if not all(isinstance(f, str) for f in weight_map.values()):
        raise HetquantError(f"{root / INDEX}: a weight_map value is not a file name; re-run the conversion")  # fmt: skip
    headers = {}
    for file in sorted(set(weight_map.values()), key=str):
        headers[file] = read_header(inside(root, file, root / INDEX, "shard")).entries
    grouped: dict[str, dict[str, tuple[str, HeaderEntry]]] = {}
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise HetquantError(f"{root / INDEX}: {name} is not in {file}; the index is corrupt")
        prefix, _, key = name.rpartition(".")
        grouped.setdefault(prefix, {})[key] = (file, headers[file][name])
    named = manifest.get("module_formats")
    trusted = isinstance(named, dict)
    named = named if trusted else {}
    modules = {}
    for prefix, entries in grouped.items():
        metas = {k: e for k, (_, e) in entries.items()}
        fmt, shape, keys = _identify(prefix, metas, named.get(prefix), trusted)
        if keys:
            modules[prefix] = ModuleInfo(prefix, fmt, shape, {k: entries[k] for k in keys})
        extras = sorted(entries.keys() - keys)  # plain tensors of their own
        for key in extras:
            mid = prefix if not keys and len(extras) == 1 else _join(prefix, key)
            modules[mid] = ModuleInfo(prefix, None, entries[key][1].shape, {key: entries[key]})
    order = sorted(modules, key=lambda m: min((f, e.start) for f, e in modules[m].entries.values()))
    pool = _select_layers(root, None, check=False) if manifest["parts"].get("cpu_experts") else {}
    cfg = parse_config(config, str(root / "config.json"))  # the only parse of this artifact's
    check_conforms(root, cfg, modules, pool)
    placement = ModelPlacement(cfg, {m: modules[m] for m in order})
    return Artifact(root, manifest, config, placement, pin=pin)


def _json(path: Path) -> dict[str, Any]:
    doc = load_json(path)
    if not isinstance(doc, dict):
        raise HetquantError(f"{path}: not a JSON object")
    return doc
