"""CPU expert-pool INT4, group-wise: 4-bit codes, one BF16 scale per group of ``g`` inputs.

The group-wise variant of ``int4_cpu`` (``formats/int4_cpu.py``: same nibble order, same layer
layout, same subpools), for checkpoints whose experts ship group-quantized, such as Kimi K2
Thinking's QAT experts (compressed-tensors pack-quantized, group 32, BF16 scales, symmetric:
``reference/model_families.md`` §1.4): they repack into it losslessly, without a dequantize /
requantize round (:func:`expert_from_ct`).

Codes and dequantization. Row ``r`` of a weight [out, in], input ``k`` in group ``j = k // g``::

    W[r, k] = (c[r, k] − 8) · f32(s[r, j])            # exact in float32 (4-bit × 8-bit)

with codes ``c ∈ 0..15`` (``q = c − 8 ∈ [−8, 7]``; our own quantizer writes 1..15, a
compressed-tensors source may hold 0) and ``s`` BF16. ``g ∈ GROUP_SIZES`` = 32, 64, 128: whole
32-element blocks, the unit of the native GEMV's exact integer sums (``runtime/kernels/int4_gemv.py``).

Round-to-nearest (:meth:`Int4CpuGroup.quantize`): ``s = amax(|W[r, group]|) / 7`` rounded *up*
to BF16 (1 for an all-zero group), ``c = clamp(round_half_even(W / s), −7, 7) + 8``, so
``|W − dequant| ≤ s / 2`` (up to float32 rounding of ``W / s``).

Nibble order: element ``2j`` of a row in the LOW nibble of byte ``j``, ``2j+1`` in the high
nibble (``_bits.pack_nibbles_u8``), as ``int4_cpu``.

==================  =====  ================  ===============================================
name                dtype  shape             content
==================  =====  ================  ===============================================
*per linear* W [out, in], ``in % g == 0``
``weight_packed``   U8     [out, in/2]       codes, packed along ``in``
``weight_scale``    BF16   [out, in/g]       ``s``, one per row and group
*per layer*: E experts, hidden H, moe intermediate I, both multiples of g; expert-major
``gate_up_packed``  U8     [E, 2I, H/2]      row-interleaved: row 2i = gate row i, 2i+1 = up row i
``gate_up_scale``   BF16   [E, 2I, H/g]      scales of those rows, same interleaving
``down_packed``     U8     [E, H, I/2]       down_proj, packed along I
``down_scale``      BF16   [E, H, I/g]       groups along I
==================  =====  ================  ===============================================

Expert ``e`` computes ``y = down · (silu(gate · x) ⊙ (up · x))``. The pool tells the two layer
formats apart by ``gate_up_scale`` (F32 [E, 2I] or BF16 [E, 2I, H/g]): ``from_stored``.

From compressed-tensors pack-quantized (symmetric, BF16 scales): the same codes and scales, the
I32 words viewed as bytes (:func:`expert_from_ct`; ``formats/int4_cpu_group_layer.py`` shows why
the bytes agree).

Subpools. Subpool ``s`` of ``S`` owns the intermediate slice ``[a, b) = [s·I/S, (s+1)·I/S)``:
rows ``[2a, 2b)`` of ``gate_up_*`` and, of ``down_*``, bytes ``[a/2, b/2)`` and groups
``[a/g, b/g)`` of every row — views, no copy. Each down group lies in one slice, so
``y = Σ_s down_s · act_s`` holds in real arithmetic. Rule: ``I/S`` a multiple of ``g`` (a slice
falls on whole groups); anything else raises HetquantError naming the legal ``S``.

Where the code lives: the row codec in ``formats/int4_cpu_group_rows.py``, the per-layer layout
(stacking, experts, the compressed-tensors repack, subpools) in ``formats/int4_cpu_group_layer.py``;
this module holds the two registered formats and re-exports both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ._lazy import torch
from .base import Streaming, TensorMeta, WeightFormat, register
from .errors import HetquantError
from .expert_layer import ExpertLayerFormat, register_expert_format
from .int4_cpu_group_layer import (
    check_subpools,
    dequantize_expert,
    expert_from_ct,
    layer_stored,
    quantize_expert,
    stack_experts,
    subpool_slice,
)
from .int4_cpu_group_rows import (
    GROUP_SIZES,
    check_group,
    check_group_size,
    dequantize_rows,
    quantize_rows,
)

__all__ = [
    "GROUP_SIZES",
    "Int4CpuGroup",
    "Int4CpuGroupExperts",
    "dequantize_expert",
    "dequantize_rows",
    "expert_from_ct",
    "layer_stored",
    "quantize_rows",
    "stack_experts",
]


@dataclass(frozen=True)
class Int4CpuGroup(WeightFormat):
    """Symmetric INT4 with one BF16 scale per row and group (see module docstring); not
    registered as a linear format yet (see the end of this module)."""

    name: ClassVar[str] = "int4_cpu_group"
    keys: ClassVar[frozenset[str]] = frozenset({"weight_packed", "weight_scale"})
    group_size: int = 32

    def __post_init__(self) -> None:
        check_group_size(self.name, self.group_size)

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Int4CpuGroup, tuple[int, int]]:
        """The variant (group size) and weight shape whose ``stored`` would be ``metas``."""
        n, half = metas["weight_packed"].shape  # two codes per byte
        group = 2 * half // metas["weight_scale"].shape[1]
        return dataclasses.replace(self, group_size=group), (n, 2 * half)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        return Streaming(self, dict.fromkeys(self.stored(shape), 0))

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"weight_packed": (0, 1), "weight_scale": (0, 1)}  # column shards on whole groups

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        out, inp = shape
        check_group(self.name, self.group_size, "in", inp)
        return {
            "weight_packed": TensorMeta("U8", (out, inp // 2)),
            "weight_scale": TensorMeta("BF16", (out, inp // self.group_size)),
        }

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        if options:
            raise HetquantError(f"{self.name}.quantize: unknown options {sorted(options)}")
        if weight.ndim != 2:
            raise HetquantError(f"{self.name}: expected a 2-D weight, got {list(weight.shape)}")
        packed, scale = quantize_rows(weight, self.group_size)
        return {"weight_packed": packed, "weight_scale": scale}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        packed = tensors.get("weight_packed")
        if packed is None or packed.ndim != 2:
            raise HetquantError(f"{self.name}: weight_packed missing or not 2-D")
        self.check_stored(tensors, (packed.shape[0], 2 * packed.shape[1]))
        return dequantize_rows(packed, tensors["weight_scale"])


@dataclass(frozen=True)
class Int4CpuGroupExperts(ExpertLayerFormat):
    """The per-layer stacked layout above, as a registered expert-layer format."""

    name: ClassVar[str] = "int4_cpu_group_experts"
    streams_rows: ClassVar[bool] = True  # quantize_rows
    cpu_kernel: ClassVar[str | None] = "int4"  # runtime/kernels/int4_gemv.py, int4_moe.py
    group_size: int = 32

    def __post_init__(self) -> None:
        check_group_size(self.name, self.group_size)

    def stored(self, num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
        return layer_stored(num_experts, hidden, inter, self.group_size)

    def quantize_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Round-to-nearest from float gate, up [I, H] and down [H, I] (module docstring)."""
        return quantize_expert(gate, up, down, self.group_size)

    def linear_format(self) -> Int4CpuGroup:
        """``int4_cpu_group`` of the same group: rows are quantized on their own."""
        return Int4CpuGroup(self.group_size)

    def quantize_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [R, K] of gate_up (interleaved) or down → (packed U8 [R, K/2], scale BF16
        [R, K/g]); rows are independent, so a converter may stream an expert by block rows."""
        if rows.ndim != 2:
            raise HetquantError(f"{self.name}: expected 2-D rows, got {list(rows.shape)}")
        return quantize_rows(rows, self.group_size)  # refuses NaN/Inf

    def from_stored(
        self, metas: Mapping[str, TensorMeta]
    ) -> tuple[Int4CpuGroupExperts, tuple[int, int, int]]:
        """The variant (group size) and (E, H, I) whose ``stored`` would be ``metas``, read from
        shapes alone; callers check ``stored(*dims) == metas`` (it may not be this layout)."""
        gu, gus, down = (metas[k].shape for k in ("gate_up_packed", "gate_up_scale", "down_packed"))
        dims = (gu[0], 2 * gu[2], 2 * down[2])
        return dataclasses.replace(self, group_size=dims[1] // gus[2]), dims

    def check_subpools(self, inter: int, num_subpools: int) -> None:
        """Raise unless ``num_subpools`` slices of ``inter`` fall on whole groups."""
        check_subpools(inter, num_subpools, self.group_size)

    def subpool_slice(
        self, layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int
    ) -> dict[str, torch.Tensor]:
        """Views of ``layer`` for subpool ``subpool`` of ``num_subpools`` (module docstring)."""
        return subpool_slice(layer, subpool, num_subpools, self.group_size)


register(Int4CpuGroup())  # served by runtime/kernels/ops.py (tinygemm on cpu/cuda; npu refuses)
register_expert_format(Int4CpuGroupExperts())
