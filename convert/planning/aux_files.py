"""Which files of a source travel into the artifact beside the converted weights.

Every small non-weight file does: tokenizers in whatever form a family ships them (Kimi K2's
``tiktoken.model`` + ``tokenization_kimi.py``, Qwen's ``vocab.json`` / ``merges.txt``,
``tokenizer.json``), chat templates (``*.jinja``), ``generation_config.json`` (eos!), remote code
(``configuration_*.py``, ``modeling_*.py``), licences, the model card. A fixed list of names would
drop the next family's tokenizer (``reference/model_families.md`` §1.6, §6: msModelSlim's copier
misses K2's ``tiktoken.model``).

The rule (:func:`aux_files`), over the regular files directly in the source directory:

- not a weight file: ``*.safetensors`` and the other checkpoint suffixes of ``WEIGHT_SUFFIXES``,
  and no ``*.index.json`` (the artifact writes its own index);
- not ``config.json`` (rewritten for the artifact) and no name in ``reserved`` (what the artifact
  writes itself: manifest, descriptions — its own file wins);
- not hidden (``.gitattributes``, ``.cache/``, partial downloads);
- at most ``max_bytes`` (``AUX_MAX_BYTES``; a larger non-weight file is skipped and reported);
- a symbolic link only when it resolves inside the source or, for a Hugging Face cache snapshot,
  its ``blobs/`` (where the cache keeps the real files; ``formats/safe_paths.py``, the one rule
  every reader applies); never one pointing elsewhere.

Sub-directories are not descended into (they hold other checkpoints, e.g. ``original/``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hetquant.formats.safe_paths import is_inside

__all__ = ["AUX_MAX_BYTES", "WEIGHT_SUFFIXES", "AuxFiles", "aux_files"]

AUX_MAX_BYTES = 64 * 2**20  # a large vocabulary's tokenizer.json is ~10-20 MB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                   ".onnx", ".npz")  # fmt: skip
NEVER = frozenset({"config.json"})


@dataclass(frozen=True)
class AuxFiles:
    """The names that travel (sorted) and those left out with the reason, by name."""

    names: list[str]
    skipped: dict[str, str]


def aux_files(src: Path, reserved: Iterable[str] = (), max_bytes: int = AUX_MAX_BYTES) -> AuxFiles:
    """The files of source directory ``src`` that travel into the artifact (module docstring)."""
    root = src.resolve()
    excluded = NEVER | set(reserved)
    names: list[str] = []
    skipped: dict[str, str] = {}
    for path in sorted(root.iterdir()):
        name = path.name
        if name.startswith(".") or name in excluded or _is_weight(name):
            continue
        real = path.resolve()
        if not is_inside(root, path):
            skipped[name] = f"a link to {real}, outside the source"
        elif not real.is_file():
            continue  # directories, sockets, broken links
        elif (size := real.stat().st_size) > max_bytes:
            skipped[name] = f"{size} bytes, over the {max_bytes}-byte bound for non-weight files"
        else:
            names.append(name)
    return AuxFiles(names, skipped)


def _is_weight(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")
