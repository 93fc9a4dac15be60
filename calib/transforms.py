"""What AWQ calibration produces and how it is saved: options, per-tensor transforms, result.

- ``AwqOptions``: calibration options (``calibrate`` and ``layer`` document the decisions).
- ``Transform`` / ``apply_transform``: what calibration does to one source tensor — column
  scales, row (norm element) divisors, per-(row, group) clip shrinks.
- ``is_quantized_linear``: the awq-w4a16 recipe's quantized set, by tensor role (the default
  targets of ``calibrate``).
- ``CalibrationResult``: the transforms of a whole checkpoint, each calibrated linear's target
  (``quantizer.Quantizer``) plus statistics; ``save`` writes ``calibration.json`` + one
  ``layer_XXX.safetensors`` per layer, ``load`` opens them lazily.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import TensorRole

from . import awq
from .quantizer import Quantizer, quantizer_for

__all__ = [
    "RESULT_FORMAT",
    "RESULT_JSON",
    "RESULT_VERSION",
    "TRANSFORM_PARTS",
    "AwqOptions",
    "CalibrationResult",
    "Transform",
    "apply_transform",
    "is_quantized_linear",
]

RESULT_JSON = "calibration.json"
RESULT_FORMAT = "hetquant-awq-calibration"
RESULT_VERSION = 1
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class AwqOptions:
    """Calibration options (defaults: AutoAWQ's, plus the decisions in the module docstrings
    of ``calibrate`` and ``layer``)."""

    method: str = "awq"  # "awq" | "rtn" (identity scales, no clip: the baseline)
    # awq_w4a16's group when ``calibrate`` picks its default targets (other targets carry their
    # own format and group); also the default ``min_expert_tokens``
    group_size: int = 128
    grid: int = 20  # scale-search grid: α = k / grid, k < grid
    duo_scaling: bool = True
    pow2_scales: bool = False  # True: scales rounded to powers of two, every fold bit-exact
    clip: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    clip_tokens: int = 512
    # module leaves never clipped; None: the model family's (``AwqMappings.clip_skip``)
    clip_skip: tuple[str, ...] | None = None
    # Off by default: the fold is exact, but it rescales kv_b_proj's v rows, which are quantized
    # too; on the trained tiny model it cost more than the o_proj search gained (ΔPPL +1.47% vs
    # +0.92% without, KL 0.0324 vs 0.0320; benchmarks/awq_sweep.py).
    fold_o_proj: bool = False
    min_expert_tokens: int | None = None  # None: group_size
    propagate: str = "quantized"  # "quantized" | "float"
    # compute dtype; None: float64 on cpu (the same transforms on every CPU: ``awq.py``,
    # "Reproducibility"), bfloat16 on accelerators
    dtype: str | None = None
    # GPTQ error feedback (``gptq.py``) for the searched MLP linears' codes, after AWQ's scale
    # and clip, where the format has a ``gptq.GRIDS`` grid (the CPU experts' INT4)
    gptq: bool = False
    gptq_damp: float = 0.01  # dampening: this fraction of mean diag(H) added to the diagonal
    gptq_act_order: bool = True
    # down's Hessian from the GPTQ-quantized gate and up (the paper's sequential order), not
    # from the float ones: KL 0.01176 against 0.01206 on the trained tiny model
    # (benchmarks/README.md "Accuracy of the CPU experts")
    gptq_sequential: bool = True
    # balances holding a W8A8 linear scored with its per-token activation quantization
    # (``smooth.py``), SmoothQuant's candidates added
    act_aware: bool = False

    def __post_init__(self) -> None:
        if self.method not in ("awq", "rtn"):
            raise HetquantError(f"calibration method {self.method!r}; use 'awq' or 'rtn'")
        if self.propagate not in ("quantized", "float"):
            raise HetquantError(f"propagate {self.propagate!r}; use 'quantized' or 'float'")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise HetquantError(f"dtype {self.dtype!r}; use one of {sorted(_DTYPES)}")
        if not 0 < self.gptq_damp < 1:
            raise HetquantError(f"gptq_damp {self.gptq_damp!r}; use a fraction in (0, 1)")

    @property
    def expert_threshold(self) -> int:
        return self.group_size if self.min_expert_tokens is None else self.min_expert_tokens

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.float64 if device.type == "cpu" else torch.bfloat16

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clip_skip"] = None if self.clip_skip is None else list(self.clip_skip)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AwqOptions:
        skip = d.get("clip_skip", ())
        return cls(**{**d, "clip_skip": None if skip is None else tuple(skip)})


@dataclass
class Transform:
    """What calibration does to one source tensor W (2-D [N, K], or a 1-D norm weight [K]):

    ``W' = clamp(fold_rows(W · diag(col_mul), row_div), ±bounds(shrink))`` — columns times
    ``col_mul`` [K], rows (norm: elements) divided by ``row_div`` [N], then, for a quantized
    linear, each (row, group) clamped to ``max|W'_group| · (1 - shrink / clip_grid)``; ``shrink``
    [N, K/g] has one column per group of its target format (one for a per-channel format). Every
    part is optional. The quantized artifact stores ``quantize(W')`` in the target format.

    With GPTQ (``gptq.py``) the linear also has ``codes`` int8 [N, K] and ``qscale`` float32
    [N, G]: then ``W' = codes · qscale`` (each scale over K/G columns), which the target format's
    round-to-nearest stores as exactly these codes and scales; the other parts stay as the
    record of what AWQ chose.
    """

    col_mul: torch.Tensor | None = None
    row_div: torch.Tensor | None = None
    shrink: torch.Tensor | None = None  # uint8 [N, K/g]
    codes: torch.Tensor | None = None  # int8 [N, K]
    qscale: torch.Tensor | None = None  # float32 [N, G]

    def to(self, device: str | torch.device) -> Transform:
        return Transform(**{k: v.to(device) for k, v in self._parts().items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self._parts().items()}  # unshared

    def _parts(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in TRANSFORM_PARTS if getattr(self, k) is not None}


TRANSFORM_PARTS = ("col_mul", "row_div", "shrink", "codes", "qscale")


def apply_transform(
    w: torch.Tensor, t: Transform | None, factors: torch.Tensor, row0: int = 0
) -> torch.Tensor:
    """``t`` applied to ``w`` (or to rows ``row0 : row0 + len(w)`` of the full tensor): float32.
    Clip groups are ``K / shrink.shape[1]`` columns wide."""
    out = w.to(torch.float32)
    if t is None:
        return out
    rows = slice(row0, row0 + out.shape[0])
    if t.codes is not None and t.qscale is not None:
        codes, qscale = t.codes[rows].to(out.device), t.qscale[rows].to(out.device)
        group = codes.shape[-1] // qscale.shape[-1]
        return codes.to(torch.float32) * qscale.to(torch.float32).repeat_interleave(group, -1)
    if t.col_mul is not None:
        out = awq.scale_columns(out, t.col_mul.to(out.device))
    if t.row_div is not None:
        div = t.row_div[rows].to(out.device)
        out = awq.fold_into_norm(out, div) if out.ndim == 1 else awq.fold_into_linear(out, div)
    if t.shrink is not None:
        shrink = t.shrink[rows].to(out.device)
        group = out.shape[-1] // shrink.shape[-1]
        out = awq.apply_clip(out, awq.clip_bounds(out, shrink, group, factors), group)
    return out


def is_quantized_linear(role: TensorRole) -> bool:
    """Whether a tensor of ``role`` is a decoder-layer linear that AWQ quantizes: every linear of
    the main layers (attention and MLP / expert projections; not the router, not the MTP
    layers; not a role every recipe keeps at source precision, as DeepSeek-V4's compressors and
    indexer) — the awq-w4a16 recipe's quantized set."""
    r = role.role
    return role.layer is not None and r.kind == "linear" and not role.mtp and not r.kept


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
            _StoredTransforms(root, doc["tensors"]),
            tuple(doc["quantized"]),
            doc["stats"],
            weights_fn,
            None if targets is None else {n: quantizer_for(*spec) for n, spec in targets.items()},
        )


class _StoredTransforms(Mapping[str, Transform]):
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
