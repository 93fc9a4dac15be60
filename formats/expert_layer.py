"""Formats that store all routed experts of one MoE layer as stacked tensors, and their registry
(``EXPERT_FORMATS``, apart from the per-linear ``FORMATS`` of ``base.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ._lazy import torch
from .base import FORMATS, TensorMeta, WeightFormat
from .errors import HetquantError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["EXPERT_FORMATS", "ExpertLayerFormat", "get_expert_format", "register_expert_format"]


@dataclass(frozen=True)
class ExpertLayerFormat(ABC):
    """A format that stores all routed experts of one MoE layer as stacked tensors.

    Stacked tensors are expert-major ([E, ...]), so expert ``e``'s part of each is the contiguous
    byte range ``[e · nbytes / E, (e + 1) · nbytes / E)`` — a converter writes experts one at a time.
    """

    name: ClassVar[str]
    # declared capabilities: a format that has one sets its flag and overrides the method.
    # ``quantize_rows(rows)`` quantizes any block of one linear's rows (the engine then streams
    # an expert's rows instead of loading its weights whole); ``quantize_rows_array`` does it
    # without torch (the native lane)
    streams_rows: ClassVar[bool] = False
    native_rows: ClassVar[bool] = False
    # ``quantize_rows_array(..., into=array)`` computes the packed codes in the array it is lent
    # (the conversion lends the output's mapped pages: no copy follows)
    native_rows_into: ClassVar[bool] = False
    # declared capability: the family of CPU expert-pool kernels that computes this layout
    # (``runtime/kernels/registry.py`` maps it to a GEMV and, where one exists, a fused MoE call;
    # None: the pool cannot serve it)
    cpu_kernel: ClassVar[str | None] = None
    # declared capability: how ``subpool_slice`` splits ``down`` along the intermediate size
    # (split="inter"): "inputs" — a subpool owns down's input columns of its slice and the
    # subpools' partial sums are added; "rows" — a subpool owns a slice of down's output rows
    # (all inputs), and the pool runs two phases: every subpool's activations first, then each
    # subpool's rows of down on all of them (runtime/experts/expert_pool.py)
    subpool_down: ClassVar[str] = "inputs"

    @abstractmethod
    def from_stored(
        self, metas: Mapping[str, TensorMeta]
    ) -> tuple[ExpertLayerFormat, tuple[int, int, int]]:
        """The variant and (E, H, I) whose ``stored`` would be ``metas`` (a layer's header), from
        shapes alone; callers check ``stored(*dims) == metas`` (it may not be this layout)."""

    @abstractmethod
    def stored(self, num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
        """Local name → dtype/shape of the layer's stacked tensors."""

    @abstractmethod
    def quantize_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """One expert's weights (gate/up [I, H], down [H, I]) → its slice of every stacked tensor."""

    def quantize_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r, in] of one linear → (packed codes, scales) of those rows; only where
        ``streams_rows``."""
        raise NotImplementedError(f"expert-layer format {self.name!r} does not stream rows")

    def quantize_rows_array(
        self, a: np.ndarray, b: np.ndarray | None = None, *, into: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``quantize_rows`` over numpy rows (``b``: a second block stacked after ``a``), without
        torch; only where ``native_rows`` (``into``: where ``native_rows_into``)."""
        raise NotImplementedError(f"expert-layer format {self.name!r} has no native rows")

    def linear_format(self) -> WeightFormat:
        """The per-linear format whose ``dequantize(quantize(W))`` is what this layout stores for
        each of an expert's gate, up and down (what calibration fake-quantizes them with).

        Raises NotImplementedError where the layout quantizes its linears jointly.
        """
        raise NotImplementedError(f"expert-layer format {self.name!r} has no per-linear format")


EXPERT_FORMATS: dict[str, ExpertLayerFormat] = {}


def register_expert_format(fmt: ExpertLayerFormat) -> ExpertLayerFormat:
    """Add an expert-layer format to ``EXPERT_FORMATS`` under ``fmt.name``."""
    if fmt.name in EXPERT_FORMATS or fmt.name in FORMATS:
        raise RuntimeError(f"format {fmt.name!r} registered twice")
    EXPERT_FORMATS[fmt.name] = fmt
    return fmt


def get_expert_format(name: str) -> ExpertLayerFormat:
    try:
        return EXPERT_FORMATS[name]
    except KeyError:
        raise HetquantError(
            f"unknown expert-layer format {name!r}; known: {', '.join(sorted(EXPERT_FORMATS))}"
        ) from None
