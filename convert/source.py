"""A source checkpoint: an HF model directory, read from headers and memory maps.

``SourceCheckpoint.open(dir)`` reads config.json, the index (or a single ``model.safetensors``)
and every shard's header, and validates them against the DeepSeek role table before any data is
read: shards that are missing, outside the directory or truncated; tensors the index names but no
shard holds; shapes that disagree with the config; FP8 weights without their scale (which may live
in another shard) or with a scale of the wrong shape. Tensor data is then read one tensor at a
time through a private memory map.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import (
    SCALE_SUFFIX,
    ModelConfig,
    TensorRole,
    expected_tensors,
    load_json,
)
from hetquant.formats.fp8_block import Fp8Block
from hetquant.formats.safetensors_io import HeaderEntry, MappedFile, read_header

__all__ = ["INDEX_NAME", "SINGLE_NAME", "SourceCheckpoint", "SourceTensor"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FP8_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the source: where its bytes are, its role, and its scale partner (FP8 only)."""

    name: str
    file: str  # shard file name, relative to the source root
    entry: HeaderEntry
    role: TensorRole
    scale_file: str | None = None
    scale: HeaderEntry | None = None

    @property
    def is_fp8(self) -> bool:
        return self.entry.dtype == FP8_DTYPE


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
    def open(
        cls, root: str | Path, revision: str | None = None, repo_id: str | None = None
    ) -> SourceCheckpoint:
        root = Path(root).resolve()
        if not root.is_dir():
            raise HetquantError(f"{root}: SOURCE is not a directory")
        cfg_path = root / "config.json"
        config = ModelConfig.load(cfg_path)
        weight_map, index_bytes = _weight_map(root)
        headers = {f: read_header(root / f) for f in sorted(set(weight_map.values()))}
        entries = _resolve_entries(weight_map, headers)
        tensors = _attach_roles(config, entries)
        digest = hashlib.sha256(index_bytes + b"\0" + cfg_path.read_bytes()).hexdigest()
        return cls(root, config, tensors, sorted(headers), digest, revision, repo_id)

    def read(self, file: str, entry: HeaderEntry) -> torch.Tensor:
        """A zero-copy view of one tensor's bytes in shard ``file`` (memory-mapped, copy-on-write)."""
        mapped = self._maps.get(path := self.root / file)
        if mapped is None:
            mapped = self._maps[path] = MappedFile(path)
        return mapped.view(entry)

    def weight(self, name: str) -> torch.Tensor:
        """The stored tensor ``name`` (FP8 codes for an FP8 weight), zero-copy."""
        t = self.tensors[name]
        return self.read(t.file, t.entry)

    def scale(self, name: str) -> torch.Tensor:
        """The ``weight_scale_inv`` of FP8 weight ``name``, zero-copy."""
        t = self.tensors[name]
        if t.scale is None or t.scale_file is None:
            raise HetquantError(f"{name}: not an FP8 weight, it has no scale")
        return self.read(t.scale_file, t.scale)

    def release(self) -> None:
        """Drop mapped pages from this process (they stay in the page cache)."""
        for m in self._maps.values():
            m.advise_dontneed()

    @property
    def total_bytes(self) -> int:
        return sum(
            t.entry.nbytes + (t.scale.nbytes if t.scale else 0) for t in self.tensors.values()
        )


def _weight_map(root: Path) -> tuple[dict[str, str], bytes]:
    index = root / INDEX_NAME
    if index.exists():
        doc = load_json(index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise HetquantError(f"{index}: no weight_map; the index is corrupt")
        first_name = {file: name for name, file in reversed(wm.items())}  # one check per shard
        for file, name in first_name.items():
            _check_inside(root, index, name, file)
            if not (root / file).is_file():
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


def _allowed_bases(root: Path) -> list[Path]:
    """Where the source's files may really live: the directory itself and, for a snapshot of the
    Hugging Face cache (``…/snapshots/<commit>``, files symlinked to ``../../blobs/``), its blobs."""
    bases = [root]
    if root.parent.name == "snapshots":
        bases.append(root.parent.parent / "blobs")
    return bases


def _check_inside(root: Path, index: Path, name: str, file: object) -> None:
    if (
        not isinstance(file, str)
        or not file
        or Path(file).is_absolute()
        or ".." in Path(file).parts
    ):
        raise HetquantError(
            f"{index}: tensor {name!r} points at {file!r}, outside the source directory; "
            "refusing an index with absolute or '..' paths"
        )
    if not any((root / file).resolve().is_relative_to(base) for base in _allowed_bases(root)):
        raise HetquantError(
            f"{index}: tensor {name!r} points at {file!r}, which resolves outside {root}"
        )


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


def _attach_roles(
    cfg: ModelConfig, entries: dict[str, tuple[str, HeaderEntry]]
) -> dict[str, SourceTensor]:
    expected = expected_tensors(cfg)
    block = Fp8Block(cfg.weight_block_size[0]) if cfg.weight_block_size else Fp8Block()
    unknown = [n for n in entries if n not in expected and not _is_scale_of(n, entries)]
    if unknown:
        raise HetquantError(
            f"tensor {unknown[0]!r} (and {len(unknown) - 1} more) matches no DeepSeek-V3 role for this "
            "config; is config.json from the same checkpoint?"
        )
    out: dict[str, SourceTensor] = {}
    for name, role in expected.items():
        if name not in entries:
            raise HetquantError(
                f"checkpoint lacks tensor {name!r}, which config.json implies; incomplete?"
            )
        file, entry = entries[name]
        if entry.shape != role.shape:
            raise HetquantError(
                f"{name}: shape {list(entry.shape)} disagrees with config.json, which implies "
                f"{list(role.shape)}"
            )
        scale_file, scale = _scale_for(name, entry, entries, block) or (None, None)
        out[name] = SourceTensor(name, file, entry, role, scale_file, scale)
    return out


def _is_scale_of(name: str, entries: dict[str, tuple[str, HeaderEntry]]) -> bool:
    return name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in entries


def _scale_for(
    name: str, entry: HeaderEntry, entries: dict[str, tuple[str, HeaderEntry]], block: Fp8Block
) -> tuple[str, HeaderEntry] | None:
    scale = entries.get(name + SCALE_SUFFIX)
    if entry.dtype != FP8_DTYPE:
        if scale is not None:
            raise HetquantError(
                f"{name}: has a {SCALE_SUFFIX} partner but is {entry.dtype}, not FP8"
            )
        return None
    if scale is None:
        raise HetquantError(
            f"{name}: FP8 weight without its {name}{SCALE_SUFFIX}; the index or shards are incomplete — "
            "without the scale the weight cannot be dequantized"
        )
    if scale[1].dtype != "F32":
        raise HetquantError(f"{name}{SCALE_SUFFIX}: dtype {scale[1].dtype}, expected F32")
    block.check_scale(name, entry.shape, scale[1].shape)
    return scale
