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

From compressed-tensors pack-quantized (``formats/ct_pack_quantized.py``; symmetric, no zero
point, no act-order, BF16 scales): its ``weight_packed`` I32 [out, in/8] holds input ``8c + i`` at
bits ``4i..4i+3`` of word ``c`` as ``q + 8``; on a little-endian machine byte ``4c + i//2`` of
the words holds inputs ``8c + i`` (low nibble, ``i`` even) and ``8c + i + 1`` (high): byte ``j``
holds elements ``2j`` and ``2j + 1``, our order and our offset. So ``weight_packed`` is the same
bytes viewed as U8 [out, in/2], and ``weight_scale`` BF16 [out, in/g] is kept as is: codes and
scales map one to one, and ``dequantize`` gives the source's ``q · f32(s)`` bit for bit.

Subpools. Subpool ``s`` of ``S`` owns the intermediate slice ``[a, b) = [s·I/S, (s+1)·I/S)``:
rows ``[2a, 2b)`` of ``gate_up_*`` and, of ``down_*``, bytes ``[a/2, b/2)`` and groups
``[a/g, b/g)`` of every row — views, no copy. Each down group lies in one slice, so
``y = Σ_s down_s · act_s`` holds in real arithmetic. Rule: ``I/S`` a multiple of ``g`` (a slice
falls on whole groups); anything else raises HetquantError naming the legal ``S``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ._lazy import torch
from .base import Streaming, TensorMeta, WeightFormat, all_finite, register
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .dtypes import divide, round_up_to, st_dtype
from .errors import HetquantError
from .expert_layer import ExpertLayerFormat, register_expert_format
from .int4_cpu_layer import LAYER_KEYS, check_metas, decode_expert, interleave_rows
from .int4_cpu_rows import QMAX, ZERO_POINT

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

GROUP_SIZES = (32, 64, 128)  # whole 32-element blocks (the GEMV's unit)
_CT_REFUSED = {
    "weight_zero_point": "asymmetric (zero-point) checkpoints have no int4_cpu_group form",
    "weight_g_idx": "act-order (weight_g_idx) permutes inputs across groups",
}


def _check_group(what: str, group_size: int, dim: str, n: int) -> None:
    if group_size not in GROUP_SIZES:
        raise HetquantError(f"{what}: group size {group_size} not in {list(GROUP_SIZES)}")
    if n <= 0 or n % group_size:
        raise HetquantError(
            f"{what}: {dim} = {n} must be a positive multiple of the group size {group_size}"
        )


def quantize_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, K] (K a multiple of g, finite) → (packed U8 [R, K/2], scale BF16 [R, K/g])."""
    r, k = w.shape
    _check_group("int4_cpu_group", group_size, "in", k)
    wg = w.to(torch.float32).reshape(r, k // group_size, group_size)  # (R, K/g, g)
    amax = wg.abs().amax(dim=-1)  # (R, K/g)
    if not all_finite(amax):
        raise HetquantError("int4_cpu_group: NaN/Inf values (or beyond float32); fix the source")
    s = round_up_to(divide(amax.double(), QMAX), "BF16")
    s = torch.where(amax > 0, s, torch.ones_like(s))  # finite: amax/7 < BF16's max
    q = (wg / s.float()[..., None]).round_().clamp_(-QMAX, QMAX)  # (R, K/g, g), |q| ≤ 7
    codes = q.reshape(r, k).add_(ZERO_POINT).to(torch.uint8)
    return pack_nibbles_u8(codes), s


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed U8 [..., R, K/2] and scale BF16 [..., R, K/g] → float32 [..., R, K]."""
    codes = unpack_nibbles_u8(packed)  # (..., R, K)
    group = codes.shape[-1] // max(scale.shape[-1], 1)
    if scale.shape[:-1] != codes.shape[:-1] or group * scale.shape[-1] != codes.shape[-1]:
        raise HetquantError(
            f"int4_cpu_group: scale {list(scale.shape)} does not fit codes {list(codes.shape)}"
        )
    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()):
        raise HetquantError("int4_cpu_group: a scale is NaN/Inf; the file is corrupt")
    return (codes.to(torch.float32) - ZERO_POINT) * s.repeat_interleave(group, dim=-1)


@dataclass(frozen=True)
class Int4CpuGroup(WeightFormat):
    """Symmetric INT4 with one BF16 scale per row and group (see module docstring); not
    registered as a linear format yet (see the end of this module)."""

    name: ClassVar[str] = "int4_cpu_group"
    keys: ClassVar[frozenset[str]] = frozenset({"weight_packed", "weight_scale"})
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise HetquantError(
                f"int4_cpu_group: group_size {self.group_size} not in {list(GROUP_SIZES)}"
            )

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
        _check_group(self.name, self.group_size, "in", inp)
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


def layer_stored(
    num_experts: int, hidden: int, inter: int, group_size: int
) -> dict[str, TensorMeta]:
    """Names, dtypes and shapes of one MoE layer's stacked tensors (module docstring)."""
    if num_experts <= 0:
        raise HetquantError(f"int4_cpu_group layer: num_experts = {num_experts} must be positive")
    _check_group("int4_cpu_group layer", group_size, "hidden", hidden)
    _check_group("int4_cpu_group layer", group_size, "moe intermediate", inter)
    e, h, i, g = num_experts, hidden, inter, group_size
    return {
        "gate_up_packed": TensorMeta("U8", (e, 2 * i, h // 2)),
        "gate_up_scale": TensorMeta("BF16", (e, 2 * i, h // g)),
        "down_packed": TensorMeta("U8", (e, h, i // 2)),
        "down_scale": TensorMeta("BF16", (e, h, i // g)),
    }


def _ct_linear(what: str, t: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One compressed-tensors linear → (packed U8 [out, in/2], scale BF16 [out, in/g]), bytes
    and values unchanged (module docstring)."""
    for key, why in _CT_REFUSED.items():
        if key in t:
            raise HetquantError(f"{what}: {key} present: {why}")
    words, scale, shape = t.get("weight_packed"), t.get("weight_scale"), t.get("weight_shape")
    if words is None or scale is None or shape is None:
        raise HetquantError(f"{what}: needs weight_packed, weight_scale and weight_shape")
    out, inp = (int(v) for v in shape.tolist())
    if words.dtype != torch.int32 or tuple(words.shape) != (out, inp // 8) or inp % 8:
        raise HetquantError(
            f"{what}: weight_packed is {words.dtype} {list(words.shape)}; expected int32 "
            f"[{out}, {inp}/8] for weight_shape {[out, inp]}"
        )
    if scale.dtype != torch.bfloat16:
        raise HetquantError(
            f"{what}: weight_scale is {st_dtype(scale.dtype)}; int4_cpu_group keeps BF16 scales "
            "and would have to round these (not lossless): use a per-channel recipe instead"
        )
    if scale.ndim != 2 or scale.shape[0] != out or not scale.shape[1] or inp % scale.shape[1]:
        raise HetquantError(
            f"{what}: weight_scale {list(scale.shape)} does not group [{out}, {inp}]"
        )
    _check_group(what, inp // scale.shape[1], "in", inp)
    return words.contiguous().view(torch.uint8), scale  # (out, in/2): the same bytes


def expert_from_ct(
    gate: Mapping[str, torch.Tensor],
    up: Mapping[str, torch.Tensor],
    down: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One expert's compressed-tensors pack-quantized linears (stored tensors of gate, up
    [I, H] and down [H, I]) → its slices of the layer tensors, ``LAYER_KEYS`` without the
    expert dim. Lossless: no value is recomputed (module docstring)."""
    gp, gs = _ct_linear("expert_from_ct: gate", gate)
    upk, us = _ct_linear("expert_from_ct: up", up)
    dp, ds = _ct_linear("expert_from_ct: down", down)
    inter, hidden = gp.shape[0], 2 * gp.shape[1]
    groups = {hidden // gs.shape[1], hidden // us.shape[1], 2 * dp.shape[1] // ds.shape[1]}
    if upk.shape != gp.shape or us.shape != gs.shape or dp.shape != (hidden, inter // 2):
        raise HetquantError(
            f"expert_from_ct: gate {[inter, hidden]}, up {[upk.shape[0], 2 * upk.shape[1]]}, "
            f"down {[dp.shape[0], 2 * dp.shape[1]]}; expected gate = up = [I, H], down = [H, I]"
        )
    if len(groups) != 1:
        raise HetquantError(f"expert_from_ct: gate, up and down use different groups {groups}")
    return {
        "gate_up_packed": interleave_rows(gp, upk),  # (2I, H/2)
        "gate_up_scale": interleave_rows(gs, us),  # (2I, H/g)
        "down_packed": dp,  # (H, I/2)
        "down_scale": ds,  # (H, I/g)
    }


def _dims(layer: Mapping[str, torch.Tensor]) -> tuple[int, int, int, int]:
    """(E, H, I, g) of a stacked layer (or subpool view), after checking every tensor."""
    gu, gus, down = (layer.get(k) for k in ("gate_up_packed", "gate_up_scale", "down_packed"))
    if gu is None or gus is None or down is None or gu.ndim != 3 or gus.ndim != 3 or down.ndim != 3:
        raise HetquantError(
            f"int4_cpu_group layer: expected 3-D {list(LAYER_KEYS)}, got {list(layer)}"
        )
    hidden, inter = 2 * gu.shape[2], 2 * down.shape[2]
    group = hidden // max(gus.shape[2], 1)
    check_metas("int4_cpu_group layer", layer, layer_stored(gu.shape[0], hidden, inter, group))
    return gu.shape[0], hidden, inter, group


def dequantize_expert(
    layer: Mapping[str, torch.Tensor], e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e`` of a layer (or subpool view) → float32 gate [I, H], up [I, H], down [H, I]."""
    return decode_expert(layer, e, _dims(layer)[0], dequantize_rows)


def stack_experts(experts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-expert slices (:func:`expert_from_ct`, or ``Int4CpuGroupExperts``
    ``.quantize_expert``) in expert order into the layer tensors."""
    if not experts:
        raise HetquantError("stack_experts: no experts given")
    layer = {k: torch.stack([x[k] for x in experts]) for k in LAYER_KEYS if k in experts[0]}
    _dims(layer)
    return layer


@dataclass(frozen=True)
class Int4CpuGroupExperts(ExpertLayerFormat):
    """The per-layer stacked layout above, as a registered expert-layer format."""

    name: ClassVar[str] = "int4_cpu_group_experts"
    streams_rows: ClassVar[bool] = True  # quantize_rows
    cpu_kernel: ClassVar[str | None] = "int4"  # runtime/kernels/int4_gemv.py, int4_moe.py
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise HetquantError(
                f"int4_cpu_group_experts: group_size {self.group_size} not in {list(GROUP_SIZES)}"
            )

    def stored(self, num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
        return layer_stored(num_experts, hidden, inter, self.group_size)

    def quantize_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Round-to-nearest from float gate, up [I, H] and down [H, I] (module docstring)."""
        for what, w in (("gate", gate), ("up", up), ("down", down)):
            if w.ndim != 2 or not all_finite(w.float()):
                raise HetquantError(f"quantize_expert: {what} must be a finite 2-D weight")
        if up.shape != gate.shape or down.shape != gate.shape[::-1]:
            raise HetquantError(
                f"quantize_expert: gate {list(gate.shape)}, up {list(up.shape)}, down "
                f"{list(down.shape)}; expected gate = up = [I, H] and down = [H, I]"
            )
        gu_packed, gu_scale = quantize_rows(interleave_rows(gate, up), self.group_size)
        d_packed, d_scale = quantize_rows(down, self.group_size)
        return {
            "gate_up_packed": gu_packed,
            "gate_up_scale": gu_scale,
            "down_packed": d_packed,
            "down_scale": d_scale,
        }

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
        s, g = num_subpools, self.group_size
        if s < 1 or inter % s or (inter // s) % g:
            legal = [
                n for n in range(1, inter // g + 1) if inter % n == 0 and (inter // n) % g == 0
            ]
            raise HetquantError(
                f"{s} subpools cannot split moe intermediate {inter} into whole groups of {g}; "
                f"legal subpool counts: {legal}"
            )

    def subpool_slice(
        self, layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int
    ) -> dict[str, torch.Tensor]:
        """Views of ``layer`` for subpool ``subpool`` of ``num_subpools`` (module docstring)."""
        _, _, inter, g = _dims(layer)
        self.check_subpools(inter, num_subpools)
        if g != self.group_size:
            raise HetquantError(f"subpool_slice: layer has group {g}, format {self.group_size}")
        if not 0 <= subpool < num_subpools:
            raise HetquantError(f"subpool_slice: subpool {subpool} not in 0..{num_subpools - 1}")
        a, b = subpool * inter // num_subpools, (subpool + 1) * inter // num_subpools
        return {
            "gate_up_packed": layer["gate_up_packed"][:, 2 * a : 2 * b],  # (E, 2I/S, H/2)
            "gate_up_scale": layer["gate_up_scale"][:, 2 * a : 2 * b],  # (E, 2I/S, H/g)
            "down_packed": layer["down_packed"][:, :, a // 2 : b // 2],  # (E, H, I/2S)
            "down_scale": layer["down_scale"][:, :, a // g : b // g],  # (E, H, I/(gS))
        }


register(Int4CpuGroup())  # served by runtime/kernels/ops.py (tinygemm on cpu/cuda; npu refuses)
register_expert_format(Int4CpuGroupExperts())
