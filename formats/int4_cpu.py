"""CPU expert-pool INT4: symmetric 4-bit codes, one F32 scale per output row.

Routed MoE experts of the ``ascend-hybrid`` recipe are stored in this format, one
``cpu_experts/layer_XX.safetensors`` per MoE layer (the *layer* layout below); any single linear
can use the per-linear format ``int4_cpu``. ``formats/int4_cpu_group.py`` is its group-wise
variant (BF16 scale per 32 / 64 / 128 inputs; same nibble order and layer layout).

Codes and dequantization. Row ``r`` of a weight [out, in] has a scale ``s[r]`` and codes
``c ∈ 1..15`` (``q = c − 8 ∈ [−7, 7]``; code 0 is never written)::

    W[r, k] = (c[r, k] − 8) · s[r]                    # computed in float32

Round-to-nearest: ``s = amax(|W[r]|) / 7`` (``s = 1`` for an all-zero row) and
``c = clamp(round_half_even(W / s), −7, 7) + 8``, so ``|W − dequant| ≤ s / 2`` (up to float32
rounding, for normal ``s``). ``clip_search=True`` tries ``s = ρ · amax / 7`` for every ρ in
``CLIP_RATIOS`` = (1.00, 0.98, …, 0.70) and keeps, per row, the ρ with the least
``‖W[r] − dequant[r]‖²`` (float64); ties keep the earlier ρ, so it is never worse than RTN.

Nibble order: element ``2j`` of a row in the LOW nibble of byte ``j``, element ``2j+1`` in the
high nibble: ``byte = c[2j] | c[2j+1] << 4`` (``_bits.pack_nibbles_u8``).

==================  =====  ==============  =================================================
name                dtype  shape           content
==================  =====  ==============  =================================================
*per linear* W [out, in], ``in`` even
``weight_packed``   U8     [out, in/2]     codes, packed along ``in``
``weight_scale``    F32    [out]           ``s``, one per row
*per layer*: E experts, hidden H, moe intermediate I, H and I even; expert-major, so each
expert's bytes are contiguous
``gate_up_packed``  U8     [E, 2I, H/2]    row-interleaved: row 2i = gate row i, 2i+1 = up row i
``gate_up_scale``   F32    [E, 2I]         scales of those rows, same interleaving
``down_packed``     U8     [E, H, I/2]     down_proj, packed along I
``down_scale``      F32    [E, H]          one scale per down row, over the whole of I
==================  =====  ==============  =================================================

Expert ``e`` computes ``y = down · (silu(gate · x) ⊙ (up · x))``.

Subpools (NUMA thread pools). Subpool ``s`` of ``S`` owns the intermediate slice
``[a, b) = [s·I/S, (s+1)·I/S)``: rows ``[2a, 2b)`` of ``gate_up_packed``/``gate_up_scale``
(one contiguous range per expert), bytes ``[a/2, b/2)`` of every ``down_packed`` row, and all of
``down_scale``. :func:`subpool_slice` returns these as views — no copy, no requantization — and
the result is itself a layer of intermediate size I/S. Because a down scale multiplies its
whole row, ``y = Σ_s down_s · act_s`` holds exactly in real arithmetic. Rules: ``S ≥ 1``,
``I % S == 0``, ``(I/S) % 2 == 0`` (a slice starts on a byte), ``0 ≤ s < S``; anything else
raises HetquantError. DeepSeek-V3 (I = 2048): S ∈ {1, 2, 4, …, 1024}; a kernel may demand more
(kt AMX INT4 needs I/S % 128 == 0, reference §1.3).

Why this layout (reference/cpu_experts.md):

- Symmetric [−7, 7], one FP32 scale per row: what kt-kernel's AMXINT4 and Kunpeng KML
  MOE_INT4 use (§3.1, §3.5: ``d = amax/112`` on a ×16 grid, i.e. ``amax/7``); kt's RAWINT4
  reference uses ``amax/7`` and ``+8`` too (§3.4). Zero is exact; FP32 per row costs 32 bits
  per 7168 or 2048 weights, so BF16 would save nothing worth its rounding.
- Offset-binary codes, ``(c − 8)·s``, as llama.cpp Q4_0 (§4.1): ``b & 0xF`` is an unsigned
  byte ready for u8×s8 dot products (VPDPBUSD, USDOT), with ``8·s·Σx`` subtracted once per row;
  ``b ^ 0x88`` gives the two's-complement nibbles that kt's AMX ``load_b_lo/hi`` expect.
- Adjacent-pair nibbles, not the split orders of Q4_0 / AMX / KML, which tie bytes to one
  kernel's block size: here any even-aligned column range is a contiguous byte range (what
  subpool slicing of down needs). A GEMV consumes it as is — low nibbles against ``x[0::2]``,
  high against ``x[1::2]``, an O(H) shuffle of the activation per token. Kernels that want
  their own tiling repack at load, as kt memcpy's into its buffers anyway (§1.4).
- Scales over the full row and one file for every S: kt quantizes each NUMA slice on its own,
  which ties its files to the thread-pool count (§0, §1.3). Row-interleaved gate/up gives each
  subpool one range per expert, and a subpool view is a plain layer of inter I/S.

Where the code lives: the row codec (quantize / dequantize of rows, clip search) in
``formats/int4_cpu_rows.py``, the per-layer layout (stacking, experts, subpools) in
``formats/int4_cpu_layer.py``; this module holds the two registered formats and re-exports both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ._lazy import torch
from ._rows_native import int4_rows_array
from .arrays import NotNative, native
from .base import Streaming, TensorMeta, WeightFormat, register
from .errors import HetquantError
from .expert_layer import ExpertLayerFormat, register_expert_format
from .int4_cpu_layer import (
    LAYER_KEYS,
    check_metas,
    check_subpools,
    dequantize_expert,
    expert_forward,
    interleave_rows,
    layer_stored,
    quantize_expert,
    stack_experts,
    subpool_slice,
)
from .int4_cpu_rows import CLIP_RATIOS, QMAX, ZERO_POINT, check_even, dequantize_rows, quantize_rows

__all__ = [
    "CLIP_RATIOS",
    "LAYER_KEYS",
    "QMAX",
    "ZERO_POINT",
    "Int4Cpu",
    "check_metas",
    "check_subpools",
    "dequantize_expert",
    "dequantize_rows",
    "expert_forward",
    "interleave_rows",
    "layer_stored",
    "quantize_expert",
    "stack_experts",
    "subpool_slice",
]


@dataclass(frozen=True)
class Int4Cpu(WeightFormat):
    """Symmetric INT4 with one F32 scale per output row (see module docstring)."""

    name: ClassVar[str] = "int4_cpu"
    native_quantize: ClassVar[bool] = True  # quantize_array
    keys: ClassVar[frozenset[str]] = frozenset({"weight_packed", "weight_scale"})

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Int4Cpu, tuple[int, int]]:
        n, half = metas["weight_packed"].shape  # two codes per byte
        return self, (n, 2 * half)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        return Streaming(self, dict.fromkeys(self.stored(shape), 0))

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"weight_packed": (0, 1), "weight_scale": (0, None)}  # a scale spans its row

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        out, inp = shape
        check_even(self.name, "in", inp)
        return {
            "weight_packed": TensorMeta("U8", (out, inp // 2)),
            "weight_scale": TensorMeta("F32", (out,)),
        }

    def quantize(
        self, weight: torch.Tensor, *, clip_search: bool = False, **options: Any
    ) -> dict[str, torch.Tensor]:
        if options:
            raise HetquantError(f"{self.name}.quantize: unknown options {sorted(options)}")
        packed, scale = quantize_rows(f"{self.name}.quantize", weight, clip_search)
        return {"weight_packed": packed, "weight_scale": scale}

    def quantize_array(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`quantize` (RTN) of numpy rows (``arrays``), by the kernel alone."""
        packed, scale = native(int4_rows_array(rows), lambda: f"{self.name}: rows {rows.dtype}")
        return {"weight_packed": packed, "weight_scale": scale}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        packed = tensors.get("weight_packed")
        if packed is None or packed.ndim != 2:
            raise HetquantError(f"{self.name}: weight_packed missing or not 2-D")
        self.check_stored(tensors, (packed.shape[0], 2 * packed.shape[1]))
        return dequantize_rows(packed, tensors["weight_scale"])


register(Int4Cpu())


@dataclass(frozen=True)
class Int4CpuExperts(ExpertLayerFormat):
    """The per-layer stacked layout above, as a registered expert-layer format."""

    name: ClassVar[str] = "int4_cpu_experts"
    streams_rows: ClassVar[bool] = True  # quantize_rows
    cpu_kernel: ClassVar[str | None] = "int4"  # runtime/kernels/int4_gemv.py, int4_moe.py
    native_rows: ClassVar[bool] = True  # quantize_rows_array
    native_rows_into: ClassVar[bool] = True  # quantize_rows_array(into=)
    clip_search: bool = False

    def stored(self, num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
        return layer_stored(num_experts, hidden, inter)

    def quantize_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return quantize_expert(gate, up, down, clip_search=self.clip_search)

    def from_stored(
        self, metas: Mapping[str, TensorMeta]
    ) -> tuple[Int4CpuExperts, tuple[int, int, int]]:
        """The variant and (E, H, I) whose ``stored`` would be ``metas`` (a layer's header), read
        from shapes alone; callers check ``stored(*dims) == metas`` (it may not be this layout)."""
        gu, down = metas["gate_up_packed"].shape, metas["down_packed"].shape
        return self, (gu[0], 2 * gu[2], 2 * down[2])

    def check_subpools(self, inter: int, num_subpools: int) -> None:
        check_subpools(inter, num_subpools)

    def subpool_slice(
        self, layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int
    ) -> dict[str, torch.Tensor]:
        return subpool_slice(layer, subpool, num_subpools)

    def linear_format(self) -> Int4Cpu:
        """``int4_cpu``: each stacked row is quantized on its own, as ``int4_cpu`` does a
        linear's rows (the weight-MSE ``clip_search`` variant has no per-linear twin)."""
        if self.clip_search:
            raise NotImplementedError("int4_cpu_experts(clip_search=True) has no per-linear format")
        return Int4Cpu()

    def quantize_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [R, K] of gate_up (interleaved) or down → (packed U8 [R, K/2], scale F32 [R]);
        rows are independent, so a converter may stream an expert one block row at a time."""
        return quantize_rows("int4_cpu_experts", rows, self.clip_search, finite=False)

    def quantize_rows_array(
        self, a: np.ndarray, b: np.ndarray | None = None, *, into: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`quantize_rows` of numpy rows ``a`` [R, K], or with ``b`` of ``a`` and ``b`` rows
        interleaved (row 2i from a, 2i + 1 from b: ``gate_up``), by the kernel alone; the packed
        codes computed into ``into`` where it fits ([R or 2R, K/2] U8, C-contiguous, writable)."""
        if self.clip_search:
            raise NotNative("int4_cpu_experts: clip search has no kernel")
        return native(
            int4_rows_array(a, b, packed=into), lambda: f"int4_cpu_experts: rows {a.dtype}"
        )


register_expert_format(Int4CpuExperts())
