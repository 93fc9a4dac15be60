"""The result of AWQ calibration and how it is saved: ``CalibrationResult``.

``CalibrationResult`` holds the transforms of a whole checkpoint (``transforms.Transform``),
each calibrated linear's target (``quantizer.Quantizer``) plus statistics; ``save`` writes
``calibration.json`` (written last: its presence marks a complete result) + one
``layer_XXX.safetensors`` per layer, ``load`` opens them lazily (``StoredTransforms``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError

from . import awq
from .quantizer import Quantizer, quantizer_for
from .transforms import TRANSFORM_PARTS, AwqOptions, Transform, apply_transform

__all__ = [
    "RESULT_FORMAT",
    "RESULT_JSON",
    "RESULT_VERSION",
    "CalibrationResult",
    "StoredTransforms",
]

RESULT_JSON = "calibration.json"
RESULT_FORMAT = "hetquant-awq-calibration"
RESULT_VERSION = 1


@dataclass
class CalibrationResult:
    """Per source tensor, what calibration changed (see ``Transform``), plus statistics.

    - ``quantized``: the linear weight names that were calibrated; store each as
      ``fmt.quantize(result.apply(name, w))`` in its target format (``quantizer(name).fmt``;
      ``targets`` None: ``AwqW4A16(options.group_size)`` for every one).
    - ``changed``: every tensor whose values change: those linears, the folded norms and the
      compensated routers. Non-linear ones are written in their source dtype
      (``result.apply(name, w).to(w.dtype)``; exact with power-of-two scales).
    - ``apply(name, w, row0)`` works on row chunks (the converter streams FP8 block rows).
    - ``weight(name)`` / ``quant_params(name)`` read the source through ``weights_fn``.
    - ``stats``: tokens per expert, fallback experts, per-layer seconds, output error and
      peak memory, the scale chosen per mapping, the calibration tokens' sha256.
    """

    options: AwqOptions
    transforms: Mapping[str, Transform]
    quantized: tuple[str, ...]
    stats: dict[str, Any] = field(default_factory=dict)
    weights_fn: Callable[[str], torch.Tensor] | None = None
    targets: Mapping[str, Quantizer] | None = None

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.transforms) | set(self.quantized)))

    @property
    def clip_factors(self) -> torch.Tensor:
        return awq.clip_factors(self.options.clip_grid, self.options.clip_max_shrink)

    def __contains__(self, name: object) -> bool:
        return name in self.transforms or name in self.quantized

    def quantizer(self, name: str) -> Quantizer:
        """The target of calibrated linear ``name`` (its format and parameters)."""
        if self.targets is None:
            return quantizer_for("awq_w4a16", {"group_size": self.options.group_size})
        try:
            return self.targets[name]
        except KeyError:
            raise HetquantError(f"{name}: not a calibrated linear") from None

    def apply(self, name: str, w: torch.Tensor, row0: int = 0) -> torch.Tensor:
        """Transformed ``w`` (source tensor ``name``, or its rows from ``row0``), float32."""
        t = self.transforms.get(name)
        return apply_transform(w, t, self.clip_factors, row0)

    def weight(self, name: str) -> torch.Tensor:
        """The transformed tensor ``name``, read through ``weights_fn``: float32."""
        if self.weights_fn is None:
            raise HetquantError("CalibrationResult.weight needs weights_fn (the source)")
        return self.apply(name, self.weights_fn(name))

    def quant_params(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales FP16, zeros) [N, K/g] for ``AwqW4A16.quantize(weight(name), scales=,
        zeros=)`` — the round-to-nearest parameters of the transformed weight (an awq_w4a16
        target's)."""
        w = self.weight(name)
        return awq.rtn_params(w, self.quantizer(name).group(w.shape[1]))

    def save(self, path: str | Path) -> Path:
        """Write ``calibration.json`` + one ``layer_XXX.safetensors`` per layer to ``path``."""
        from safetensors.torch import save_file

        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, torch.Tensor]] = {}
        where: dict[str, str] = {}
        for name, t in sorted(self.transforms.items()):
            file = f"layer_{int(name.split('.')[2]):03d}.safetensors"
            where[name] = file
            for key, v in t.tensors().items():
                files.setdefault(file, {})[f"{name}:{key}"] = v
        for file, tensors in files.items():
            tmp = root / f".{file}.tmp"
            save_file(tensors, str(tmp))
            tmp.replace(root / file)
        doc = {
            "format": RESULT_FORMAT,
            "version": RESULT_VERSION,
            "options": self.options.to_dict(),
            "quantized": list(self.quantized),
            "targets": {n: self.quantizer(n).spec() for n in self.quantized},
            "tensors": where,
            "stats": self.stats,
        }
        tmp = root / f".{RESULT_JSON}.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(root / RESULT_JSON)  # written last: its presence marks a complete result
        return root

    @classmethod
    def load(
        cls, path: str | Path, weights_fn: Callable[[str], torch.Tensor] | None = None
    ) -> CalibrationResult:
        """Open a saved result; transforms are read from disk when asked for."""
        root = Path(path)
        try:
            doc = json.loads((root / RESULT_JSON).read_text())
        except FileNotFoundError:
            raise HetquantError(f"{root}: no {RESULT_JSON}; not a (complete) calibration") from None
        if doc.get("format") != RESULT_FORMAT or doc.get("version") != RESULT_VERSION:
            raise HetquantError(f"{root / RESULT_JSON}: not a {RESULT_FORMAT} v{RESULT_VERSION}")
        options = dict(doc["options"])
        targets = doc.get("targets")  # absent in results saved before targets were recorded
        legacy = options.pop("quantizer", None)  # those named one format for every linear
        if targets is None and legacy is not None:
            params = {"group_size": options["group_size"]}
            targets = {n: (legacy, params) for n in doc["quantized"]}
        return cls(
            AwqOptions.from_dict(options),
            StoredTransforms(root, doc["tensors"]),
            tuple(doc["quantized"]),
            doc["stats"],
            weights_fn,
            None if targets is None else {n: quantizer_for(*spec) for n, spec in targets.items()},
        )


class StoredTransforms(Mapping[str, Transform]):
    """Transforms of a saved result, read lazily per tensor (memory-mapped safetensors)."""

    def __init__(self, root: Path, where: Mapping[str, str]) -> None:
        self.root, self.where = root, dict(where)
        self._open: dict[str, tuple[Any, set[str]]] = {}

    def __getitem__(self, name: str) -> Transform:
        from safetensors import safe_open

        file = self.where[name]
        if file not in self._open:
            f = safe_open(str(self.root / file), framework="pt")
            self._open[file] = (f, set(f.keys()))
        f, keys = self._open[file]
        got = {k: f.get_tensor(f"{name}:{k}") for k in TRANSFORM_PARTS
               if f"{name}:{k}" in keys}  # fmt: skip
        return Transform(**got)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)
