"""The per-layer expert layout of ``int4_cpu_group`` (``formats/int4_cpu_group.py`` documents
the stacked tensors and the subpool rule): build a layer from float experts or, losslessly, from
compressed-tensors pack-quantized experts, read experts back, and slice a layer into subpool views.

From compressed-tensors pack-quantized (``formats/ct_pack_quantized.py``; symmetric, no zero
point, no act-order, BF16 scales): its ``weight_packed`` I32 [out, in/8] holds input ``8c + i`` at
bits ``4i..4i+3`` of word ``c`` as ``q + 8``; on a little-endian machine byte ``4c + i//2`` of
the words holds inputs ``8c + i`` (low nibble, ``i`` even) and ``8c + i + 1`` (high): byte ``j``
holds elements ``2j`` and ``2j + 1``, our order and our offset. So ``weight_packed`` is the same
bytes viewed as U8 [out, in/2], and ``weight_scale`` BF16 [out, in/g] is kept as is: codes and
scales map one to one, and ``dequantize`` gives the source's ``q · f32(s)`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._lazy import torch
from .base import TensorMeta, all_finite
from .dtypes import st_dtype
from .errors import HetquantError
from .int4_cpu_group_rows import check_group, dequantize_rows, quantize_rows
from .int4_cpu_layer import LAYER_KEYS, check_metas, decode_expert, interleave_rows

__all__ = [
    "check_subpools",
    "dequantize_expert",
    "expert_from_ct",
    "layer_dims",
    "layer_stored",
    "quantize_expert",
    "stack_experts",
    "subpool_slice",
]

_CT_REFUSED = {
    "weight_zero_point": "asymmetric (zero-point) checkpoints have no int4_cpu_group form",
    "weight_g_idx": "act-order (weight_g_idx) permutes inputs across groups",
}


def layer_stored(
    num_experts: int, hidden: int, inter: int, group_size: int
) -> dict[str, TensorMeta]:
    """Names, dtypes and shapes of one MoE layer's stacked tensors (``int4_cpu_group``'s
    module docstring)."""
    if num_experts <= 0:
        raise HetquantError(f"int4_cpu_group layer: num_experts = {num_experts} must be positive")
    check_group("int4_cpu_group layer", group_size, "hidden", hidden)
    check_group("int4_cpu_group layer", group_size, "moe intermediate", inter)
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
    check_group(what, inp // scale.shape[1], "in", inp)
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


def layer_dims(layer: Mapping[str, torch.Tensor]) -> tuple[int, int, int, int]:
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
    return decode_expert(layer, e, layer_dims(layer)[0], dequantize_rows)


def stack_experts(experts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-expert slices (:func:`expert_from_ct`, or ``Int4CpuGroupExperts``
    ``.quantize_expert``) in expert order into the layer tensors."""
    if not experts:
        raise HetquantError("stack_experts: no experts given")
    layer = {k: torch.stack([x[k] for x in experts]) for k in LAYER_KEYS if k in experts[0]}
    layer_dims(layer)
    return layer


def quantize_expert(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group_size: int
) -> dict[str, torch.Tensor]:
    """Round-to-nearest from float gate, up [I, H] and down [H, I] (``int4_cpu_group_rows``)."""
    for what, w in (("gate", gate), ("up", up), ("down", down)):
        if w.ndim != 2 or not all_finite(w.float()):
            raise HetquantError(f"quantize_expert: {what} must be a finite 2-D weight")
    if up.shape != gate.shape or down.shape != gate.shape[::-1]:
        raise HetquantError(
            f"quantize_expert: gate {list(gate.shape)}, up {list(up.shape)}, down "
            f"{list(down.shape)}; expected gate = up = [I, H] and down = [H, I]"
        )
    gate_up = quantize_rows(interleave_rows(gate, up), group_size)  # (2I, H/2), (2I, H/g)
    return dict(zip(LAYER_KEYS, (*gate_up, *quantize_rows(down, group_size)), strict=True))


def check_subpools(inter: int, num_subpools: int, group_size: int) -> None:
    """Raise unless ``num_subpools`` slices of ``inter`` fall on whole groups."""
    s, g = num_subpools, group_size
    if s < 1 or inter % s or (inter // s) % g:
        legal = [n for n in range(1, inter // g + 1) if inter % n == 0 and (inter // n) % g == 0]
        raise HetquantError(
            f"{s} subpools cannot split moe intermediate {inter} into whole groups of {g}; "
            f"legal subpool counts: {legal}"
        )


def subpool_slice(
    layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int, group_size: int
) -> dict[str, torch.Tensor]:
    """Views of ``layer`` for subpool ``subpool`` of ``num_subpools``: rows ``[2a, 2b)`` of
    ``gate_up_*``, bytes ``[a/2, b/2)`` and groups ``[a/g, b/g)`` of ``down_*`` (no copy)."""
    _, _, inter, g = layer_dims(layer)
    check_subpools(inter, num_subpools, group_size)
    if g != group_size:
        raise HetquantError(f"subpool_slice: layer has group {g}, format {group_size}")
    if not 0 <= subpool < num_subpools:
        raise HetquantError(f"subpool_slice: subpool {subpool} not in 0..{num_subpools - 1}")
    a, b = subpool * inter // num_subpools, (subpool + 1) * inter // num_subpools
    return {
        "gate_up_packed": layer["gate_up_packed"][:, 2 * a : 2 * b],  # (E, 2I/S, H/2)
        "gate_up_scale": layer["gate_up_scale"][:, 2 * a : 2 * b],  # (E, 2I/S, H/g)
        "down_packed": layer["down_packed"][:, :, a // 2 : b // 2],  # (E, H, I/2S)
        "down_scale": layer["down_scale"][:, :, a // g : b // g],  # (E, H, I/(gS))
    }
