"""The ``cpu_experts/layer_XXX.safetensors`` files of a hybrid artifact: discovery and mapping.

``_cpu_expert_files`` lists the files from the manifest (``hetquant.json`` →
``parts.cpu_experts.files``), ``_layers_of`` reads one file's safetensors header into an
:class:`ExpertLayerInfo` per MoE layer — its layout is the registered expert-layer format whose
``from_stored`` gives back the header's dtypes and shapes (``int4_cpu_experts``, per-channel F32
scales, or ``int4_cpu_group_experts``, BF16 group scales; ``formats/int4_cpu*.py``) —
``_select_layers`` collects the layers of all files (or the requested ones), and ``_Mapping``
maps one file for :class:`~hetquant.runtime.experts.expert_pool.CpuExpertPool`.

Memory. Every layer file is mapped whole with a private copy-on-write ``mmap`` (the file is never
written; pages are page cache shared with other processes) and every tensor is a zero-copy view
of that one mapping (``CpuExpertPool.mapped_ranges`` gives the address ranges). Nothing is read
at open except the headers and the pages each subpool touches.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from hetquant.formats import EXPERT_FORMATS, HetquantError, TensorMeta
from hetquant.formats.dtypes import itemsize, torch_dtype
from hetquant.formats.families import ModelFamily, load_config
from hetquant.formats.filenames import MANIFEST_NAME
from hetquant.formats.int4_cpu import LAYER_KEYS
from hetquant.formats.manifest_schema import read_manifest
from hetquant.formats.safe_paths import inside, open_binary
from hetquant.formats.safetensors_io import HeaderEntry, read_header

from ..loading.conformance import check_pool_layers

__all__ = [
    "MANIFEST",
    "ExpertLayerInfo",
    "PoolLayout",
    "_Mapping",
    "_cpu_expert_files",
    "_layers_of",
    "_select_layers",
]

MANIFEST = MANIFEST_NAME


class PoolLayout(Protocol):
    """What the pool needs of an expert-layer format beyond ``ExpertLayerFormat``."""

    name: str

    def check_subpools(self, inter: int, num_subpools: int) -> None: ...

    def subpool_slice(
        self, layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int
    ) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class ExpertLayerInfo:
    """One MoE layer of the pool: where it lives, its dims (E experts, hidden H, inter I) and
    its layout (an expert-layer format with ``subpool_slice`` and ``check_subpools``)."""

    layer: int
    path: Path
    prefix: str  # tensor-name prefix: the family's stacked experts module of the layer
    num_experts: int
    hidden: int
    inter: int
    entries: dict[str, HeaderEntry]  # LAYER_KEYS → header entry
    fmt: PoolLayout  # its expert-layer format, e.g. Int4CpuGroupExperts(group_size=32)


# ------------------------------------------------------------------------------------------------
# manifest and headers


def _cpu_expert_files(artifact: Path) -> list[Path]:
    man = artifact / MANIFEST
    doc = read_manifest(artifact)  # its schema checked: parts.*.files are lists of strings
    if doc.get("complete") is not True:
        raise HetquantError(f"{man}: the artifact is not complete; re-run the conversion")
    files = doc["parts"].get("cpu_experts", {}).get("files")
    if not files:
        recipe = doc.get("recipe", {}).get("name", "?")
        raise HetquantError(
            f"{artifact}: the artifact (recipe {recipe}) has no cpu_experts part; convert with "
            "--recipe ascend-hybrid to get CPU experts"
        )
    out = []
    for rel in files:
        p = inside(artifact, rel, man, "cpu_experts file")
        if not p.exists():  # a FIFO or directory: read_header names what it is
            raise HetquantError(f"{artifact}: cpu_experts file {rel} is missing; re-download it")
        out.append(p)
    return out


def _layers_of(path: Path, family: ModelFamily) -> list[ExpertLayerInfo]:
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
        loc = family.locate(prefix)
        if loc is None or loc.role is not None or loc.layer is None:
            raise HetquantError(
                f"{path}: tensor prefix {prefix!r} is not a layer's stacked routed experts of "
                f"model family {family.name}"
            )
        missing = [k for k in LAYER_KEYS if k not in entries]
        if missing:
            raise HetquantError(f"{path}: {prefix} lacks {', '.join(missing)}")
        fmt, dims = _identify(path, prefix, {k: entries[k].meta for k in LAYER_KEYS})
        out.append(ExpertLayerInfo(loc.layer, path, prefix, *dims, entries, fmt))
    return out


def _identify(
    path: Path, prefix: str, metas: dict[str, TensorMeta]
) -> tuple[PoolLayout, tuple[int, int, int]]:
    """The registered expert-layer format (with its parameters) whose layout ``metas`` are: the
    one whose ``from_stored`` answer gives back exactly ``metas``."""
    for fmt in EXPERT_FORMATS.values():
        try:
            variant, dims = fmt.from_stored(metas)
            if variant.stored(*dims) == metas:
                return variant, dims
        except (HetquantError, KeyError, IndexError, ValueError, ArithmeticError):
            continue  # not this layout
    shown = ", ".join(f"{k} {m.dtype} {list(m.shape)}" for k, m in metas.items())
    known = list(EXPERT_FORMATS)
    raise HetquantError(
        f"{path}: {prefix} is no CPU expert layout the pool serves ({shown}); expected one of "
        f"{known} (formats/int4_cpu*.py); re-convert the artifact"
    )


def _select_layers(
    artifact: Path, layers: Iterable[int] | None, *, check: bool = True
) -> dict[int, ExpertLayerInfo]:
    """The layers of ``artifact``'s cpu_experts files, keyed by layer number; only ``layers``
    (all if None). ``check``: refuse layers that disagree with config.json (``open_artifact``
    passes False: it checks them with the rest of the artifact)."""
    infos: dict[int, ExpertLayerInfo] = {}
    files = _cpu_expert_files(artifact)
    cfg = load_config(artifact / "config.json")
    for path in files:
        for info in _layers_of(path, cfg.family):
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
    if check:  # dims and experts as config.json implies
        check_pool_layers(artifact, cfg, infos)
    return infos


# ------------------------------------------------------------------------------------------------
# the mapping


class _Mapping:
    """One file, mapped whole (private, copy-on-write); views are slices of one uint8 tensor."""

    def __init__(self, path: Path) -> None:
        with open_binary(path) as f:
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
