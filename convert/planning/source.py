"""A source checkpoint: an HF model directory, read from headers and memory maps.

``SourceCheckpoint.open(dir)`` reads config.json, the index (or a single ``model.safetensors``)
and every shard's header, and validates them against the model family's role table before any
data is read — the config's layer and expert counts against the index first, before any name is
expanded (``formats/families/bounds.py``): shards that are missing, outside the directory or truncated; tensors the index names
but no shard holds; shapes that disagree with the config.

A source is any registered format: a role's linear weight is the module of stored tensors under
its prefix (``q_a_proj.weight`` + ``q_a_proj.weight_scale_inv``, which may live in another shard;
``weight_packed`` / ``weight_scale`` / ``weight_shape`` of compressed-tensors, ...), recognised
by ``formats.identify`` — the one whose parameters config.json fixes, for FP8 the block edge — and
dequantized by that format's own ``source_rows`` (which also validates it). Tensors no format
claims are plain and must have a float dtype. Data is read through a private memory map.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetquant.formats import HetquantError, WeightFormat
from hetquant.formats._gc import paused_gc
from hetquant.formats._lazy import torch
from hetquant.formats._quant_native import absmax_array
from hetquant.formats.arrays import NotNative, RowsInto, float_row_arrays, native
from hetquant.formats.base import float_rows
from hetquant.formats.families import ModelConfig, TensorRole, check_index_holds, load_json
from hetquant.formats.filenames import INDEX_NAME, SINGLE_NAME
from hetquant.formats.safe_paths import inside
from hetquant.formats.safetensors_io import HeaderEntry, MappedFile, read_header

from ..fs.os_errors import naming
from .roles import PLAIN, attach_roles

__all__ = ["INDEX_NAME", "PLAIN", "SINGLE_NAME", "SourceCheckpoint", "SourceTensor"]


@dataclass(frozen=True)
class SourceTensor:
    """One role's tensor in the source: a module in a weight format, or one plain tensor."""

    name: str  # the role's tensor name (``….weight`` for a linear)
    role: TensorRole
    parts: dict[str, tuple[str, HeaderEntry]]  # stored key → (shard file, header entry)
    fmt: WeightFormat | None = None  # None: plain, used as stored

    @property
    def prefix(self) -> str:
        """Module prefix of a formatted weight (``parts`` keys are relative to it)."""
        return self.name.rpartition(".")[0]

    @property
    def main(self) -> HeaderEntry:
        """The tensor that carries the role's name (a plain tensor) or the module's weight: its
        ``weight`` part, else its largest part (the codes: ``weight_packed`` of compressed-tensors)."""
        if "weight" in self.parts:
            return self.parts["weight"][1]
        return max((e for _, e in self.parts.values()), key=lambda e: e.nbytes)

    @property
    def dtype(self) -> str:
        return self.main.dtype

    @property
    def fmt_name(self) -> str:
        return PLAIN if self.fmt is None else self.fmt.name

    @property
    def fmt_params(self) -> tuple[tuple[str, Any], ...]:
        """The source format variant's parameters (``(("group_size", 32), ...)``; () plain)."""
        return () if self.fmt is None else tuple(self.fmt.params.items())

    @property
    def shape(self) -> tuple[int, ...]:
        return self.role.shape

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for _, e in self.parts.values())


@dataclass
class SourceCheckpoint:
    """A validated source directory (see module docstring)."""

    root: Path
    config: ModelConfig
    tensors: dict[str, SourceTensor]
    shard_files: list[str]
    fingerprint: str
    revision: str | None = None
    repo_id: str | None = None  # Hub repo the source came from, if any
    _maps: dict[Path, MappedFile] = field(default_factory=dict, repr=False)

    @classmethod
    @paused_gc()  # a graph of ~10^5-10^6 objects, no cycles (formats/_gc.py)
    def open(
        cls, root: str | Path, revision: str | None = None, repo_id: str | None = None
    ) -> SourceCheckpoint:
        root = Path(root).resolve()
        if not root.is_dir():
            raise HetquantError(f"{root}: SOURCE is not a directory")
        cfg_path = root / "config.json"
        config = ModelConfig.load(cfg_path)
        weight_map, index_bytes = _weight_map(root)
        check_index_holds(config, weight_map.keys(), _index_label(root))  # before any expansion
        headers = {f: read_header(root / f) for f in sorted(set(weight_map.values()))}
        entries = _resolve_entries(weight_map, headers)
        tensors = {
            name: SourceTensor(name, role, parts, fmt)
            for name, (role, parts, fmt) in attach_roles(config, entries).items()
        }
        digest = hashlib.sha256(index_bytes + b"\0" + cfg_path.read_bytes()).hexdigest()
        return cls(root, config, tensors, sorted(headers), digest, revision, repo_id)

    def _mapped(self, file: str) -> MappedFile:
        mapped = self._maps.get(path := self.root / file)
        if mapped is None:
            with naming(path):  # ENOMEM, EMFILE from mmap: no path of their own
                mapped = self._maps[path] = MappedFile(path)
        return mapped

    def read(self, file: str, entry: HeaderEntry) -> torch.Tensor:
        """A zero-copy view of one tensor's bytes in shard ``file`` (memory-mapped, copy-on-write)."""
        return self._mapped(file).view(entry)

    def array(self, file: str, entry: HeaderEntry) -> np.ndarray:
        """:meth:`read` as a numpy array (BF16 and FP8 as their bits: ``dtypes.numpy_dtype``)."""
        return self._mapped(file).array(entry)

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """:meth:`stored` as numpy arrays."""
        return {k: self.array(f, e) for k, (f, e) in self.tensors[name].parts.items()}

    def weight_array(self, name: str) -> tuple[str, np.ndarray]:
        """(safetensors dtype, :meth:`weight` as a numpy array)."""
        t = self.tensors[name]
        file, entry = t.parts.get("weight", next(iter(t.parts.values())))
        return entry.dtype, self.array(file, entry)

    def row_arrays(self, name: str, into: RowsInto | None = None) -> Iterator[tuple[int, np.ndarray]]:  # fmt: skip
        """:meth:`rows` as numpy arrays, by the formats' native kernels
        (``formats/arrays.py``; computed rows into ``into``'s arrays where it gives them);
        raises ``NotNative`` where they cannot."""
        t = self.tensors[name]
        if t.fmt is None:
            return float_row_arrays(name, self.weight_array(name)[1])
        if not t.fmt.native_source:
            raise NotNative(f"{name}: source format {t.fmt.name} has no native rows")
        return t.fmt.source_row_arrays(t.prefix, self.arrays(name), t.shape, into)  # type: ignore[arg-type]

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The stored tensors of role ``name`` by key, zero-copy."""
        return {k: self.read(f, e) for k, (f, e) in self.tensors[name].parts.items()}

    def weight(self, name: str) -> torch.Tensor:
        """The tensor carrying role ``name`` as stored (a quantized module's codes), zero-copy."""
        t = self.tensors[name]
        return self.read(*t.parts.get("weight", next(iter(t.parts.values()))))

    def rows(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of a 2-D source weight, validated, a block of rows at a time:
        a format dequantizes exactly to BF16 (its ``source_rows``), a plain one comes as stored."""
        t = self.tensors[name]
        if t.fmt is None:
            return float_rows(name, self.weight(name))
        return t.fmt.source_rows(t.prefix, self.stored(name), t.shape)  # type: ignore[arg-type]

    def absmax(self, name: str) -> float:
        """``max |W|`` of a source weight as :meth:`rows` gives it (a format may know it cheaper)."""
        t = self.tensors[name]
        if t.fmt is None:
            return max((float(r.abs().amax()) for _, r in self.rows(name)), default=0.0)
        return t.fmt.source_absmax(t.prefix, self.stored(name), t.shape)  # type: ignore[arg-type]

    def absmax_array(self, name: str) -> float:
        """:meth:`absmax` by the formats' native kernels, without torch; raises ``NotNative``
        where they cannot (the torch code then gives the value or the error)."""
        t = self.tensors[name]
        if t.fmt is None:
            return max((native(absmax_array(r), name) for _, r in self.row_arrays(name)), default=0.0)  # fmt: skip
        if not t.fmt.native_source:
            raise NotNative(f"{name}: source format {t.fmt.name} has no native absmax")
        return t.fmt.source_absmax_array(t.prefix, self.arrays(name), t.shape)  # type: ignore[arg-type]

    def dequantized(self, name: str) -> torch.Tensor:
        """A whole source tensor: a format's weight exactly as BF16, a plain one as stored."""
        t = self.tensors[name]
        if t.fmt is None:
            return self.weight(name)
        return t.fmt.source_dequantized(t.prefix, self.stored(name), t.shape)  # type: ignore[arg-type]

    def release(self) -> None:
        """Drop mapped pages from this process (they stay in the page cache)."""
        for m in self._maps.values():
            m.advise_dontneed()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _index_label(root: Path) -> str:
    """What names the source's tensors: its index, or its one ``model.safetensors``."""
    return str(root / (INDEX_NAME if (root / INDEX_NAME).exists() else SINGLE_NAME))


def _weight_map(root: Path) -> tuple[dict[str, str], bytes]:
    index = root / INDEX_NAME
    if index.exists():
        doc = load_json(index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise HetquantError(f"{index}: no weight_map; the index is corrupt")
        first_name = {file: name for name, file in reversed(wm.items())}  # one check per shard
        for file, name in first_name.items():
            inside(root, file, index, f"tensor {name!r}: shard", kind="source")
            if not (root / file).exists():  # a FIFO or directory: read_header names what it is
                raise HetquantError(
                    f"{index}: tensor {name!r} is in shard {file!r}, which does not exist in {root}; "
                    "the download is incomplete — fetch the missing shard"
                )
        return dict(wm), index.read_bytes()
    single = root / SINGLE_NAME
    if single.is_file():
        names = read_header(single).entries
        return {n: SINGLE_NAME for n in names}, json.dumps(sorted(names)).encode()
    raise HetquantError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME}; not an HF checkpoint")


def _resolve_entries(
    weight_map: dict[str, str], headers: dict[str, object]
) -> dict[str, tuple[str, HeaderEntry]]:
    out: dict[str, tuple[str, HeaderEntry]] = {}
    for name, file in weight_map.items():
        entry = headers[file].entries.get(name)  # type: ignore[attr-defined]
        if entry is None:
            raise HetquantError(
                f"index names tensor {name!r} in {file}, but that shard does not hold it"
            )
        out[name] = (file, entry)
    return out
