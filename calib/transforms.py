"""What AWQ calibration produces: options and per-tensor transforms.

- ``AwqOptions``: calibration options (``calibrate`` and ``layer`` document the decisions).
- ``Transform`` / ``apply_transform``: what calibration does to one source tensor — column
  scales, row (norm element) divisors, per-(row, group) clip shrinks.
- ``is_quantized_linear``: the awq-w4a16 recipe's quantized set, by tensor role (the default
  targets of ``calibrate``).

The transforms of a whole checkpoint, and how they are saved and loaded, are
``result.CalibrationResult`` (``calib/result.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import TensorRole

from . import awq

__all__ = ["TRANSFORM_PARTS", "AwqOptions", "Transform", "apply_transform", "is_quantized_linear"]

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
