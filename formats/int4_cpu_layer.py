"""The per-layer expert layout of ``int4_cpu`` (``formats/int4_cpu.py`` documents the stacked
tensors and the subpool rules): build a layer from float experts, read experts back, run the
reference SwiGLU, and slice a layer into subpool views.

Every expert's rows go through the row codec (``formats/int4_cpu_rows.py``); gate and up rows
are interleaved (row 2i = gate row i, 2i+1 = up row i) so that a subpool owns one range of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ._lazy import torch
from ._rows_native import int4_rows
from .base import TensorMeta
from .dtypes import st_dtype
from .errors import HetquantError
from .int4_cpu_rows import check_even, check_weight, dequantize_rows, quantize_rows_torch

__all__ = [
    "LAYER_KEYS",
    "check_metas",
    "check_subpools",
    "decode_expert",
    "dequantize_expert",
    "expert_forward",
    "interleave_rows",
    "layer_stored",
    "quantize_expert",
    "stack_experts",
    "subpool_slice",
]

LAYER_KEYS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


def layer_stored(num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
    """Names, dtypes and shapes of one MoE layer's stacked tensors (module docstring)."""
    if num_experts <= 0:
        raise HetquantError(f"int4_cpu layer: num_experts = {num_experts} must be positive")
    check_even("int4_cpu layer", "hidden", hidden)
    check_even("int4_cpu layer", "moe intermediate", inter)
    e, h, i = num_experts, hidden, inter
    return {
        "gate_up_packed": TensorMeta("U8", (e, 2 * i, h // 2)),
        "gate_up_scale": TensorMeta("F32", (e, 2 * i)),
        "down_packed": TensorMeta("U8", (e, h, i // 2)),
        "down_scale": TensorMeta("F32", (e, h)),
    }


def check_metas(
    what: str, tensors: Mapping[str, torch.Tensor], want: Mapping[str, TensorMeta]
) -> None:
    if set(tensors) != set(want):
        raise HetquantError(f"{what}: tensors {sorted(tensors)} != expected {sorted(want)}")
    for key, meta in want.items():
        got = TensorMeta(st_dtype(tensors[key].dtype), tuple(tensors[key].shape))
        if got != meta:
            raise HetquantError(f"{what}: {key} is {got}, expected {meta}")


def _layer_dims(layer: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """(E, H, I) of a stacked layer (or subpool view), after checking every tensor."""
    gu, down = layer.get("gate_up_packed"), layer.get("down_packed")
    if gu is None or down is None or gu.ndim != 3 or down.ndim != 3:
        raise HetquantError(f"int4_cpu layer: expected 3-D {list(LAYER_KEYS)}, got {list(layer)}")
    dims = (gu.shape[0], 2 * gu.shape[2], 2 * down.shape[2])
    check_metas("int4_cpu layer", layer, layer_stored(*dims))
    return dims


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows of gate and up [I, ...] interleaved into [2I, ...]: row 2i = gate i, 2i+1 = up i."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def quantize_expert(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, clip_search: bool = False
) -> dict[str, torch.Tensor]:
    """One expert's slices of the layer tensors: gate, up [I, H] and down [H, I] (float).

    Returns the ``LAYER_KEYS`` without the expert dim, e.g. ``gate_up_packed`` [2I, H/2], so a
    converter can write expert ``e`` at index ``e`` of each stacked tensor as it goes.
    """
    for what, w in (("gate", gate), ("up", up), ("down", down)):
        if w.ndim != 2:
            raise HetquantError(f"quantize_expert: {what}: expected a 2-D weight, got shape {list(w.shape)}")  # fmt: skip
        check_even(f"quantize_expert: {what}", "in", w.shape[1])
    inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (hidden, inter):
        raise HetquantError(
            f"quantize_expert: gate {list(gate.shape)}, up {list(up.shape)}, down "
            f"{list(down.shape)}; expected gate = up = [I, H] and down = [H, I]"
        )
    check_even("quantize_expert", "moe intermediate", inter)
    fast = None if clip_search else (int4_rows(gate, up), int4_rows(down))
    if fast is not None and None not in fast:  # the fused kernel, gate/up rows interleaved
        (gu_packed, gu_scale), (d_packed, d_scale) = fast  # type: ignore[misc]
    else:
        g, u, d = (check_weight(f"quantize_expert: {n}", w) for n, w in (("gate", gate), ("up", up), ("down", down)))  # fmt: skip
        gu_packed, gu_scale = quantize_rows_torch(interleave_rows(g, u), clip_search)  # (2I, H)
        d_packed, d_scale = quantize_rows_torch(d, clip_search)
    return {
        "gate_up_packed": gu_packed,
        "gate_up_scale": gu_scale,
        "down_packed": d_packed,
        "down_scale": d_scale,
    }


def stack_experts(experts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack :func:`quantize_expert` outputs (expert order) into the layer tensors."""
    if not experts:
        raise HetquantError("stack_experts: no experts given")
    first = experts[0]
    if set(first) != set(LAYER_KEYS) or first["gate_up_packed"].ndim != 2:
        raise HetquantError(f"stack_experts: expert 0 has {sorted(first)}, expected {LAYER_KEYS}")
    hidden, inter = 2 * first["gate_up_packed"].shape[1], first["gate_up_scale"].shape[0] // 2
    want = {k: TensorMeta(m.dtype, m.shape[1:]) for k, m in layer_stored(1, hidden, inter).items()}
    for e, expert in enumerate(experts):
        check_metas(f"stack_experts: expert {e}", expert, want)
    return {k: torch.stack([x[k] for x in experts]) for k in LAYER_KEYS}


def dequantize_expert(
    layer: Mapping[str, torch.Tensor], e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e`` of a layer (or subpool view) → float32 gate [I, H], up [I, H], down [H, I]."""
    return decode_expert(layer, e, _layer_dims(layer)[0], dequantize_rows)


def decode_expert(
    layer: Mapping[str, torch.Tensor],
    e: int,
    num_experts: int,
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e`` of a checked layer of ``num_experts`` → float32 gate [I, H], up [I, H], down
    [H, I], each stacked tensor's rows decoded by ``rows(packed, scale)`` (the per-channel or
    the group-wise ``dequantize_rows``: both layouts interleave gate/up rows alike)."""
    if not 0 <= e < num_experts:
        raise HetquantError(f"dequantize_expert: expert {e} not in 0..{num_experts - 1}")
    gate_up = rows(layer["gate_up_packed"][e], layer["gate_up_scale"][e])  # (2I, H)
    down = rows(layer["down_packed"][e], layer["down_scale"][e])  # (H, I)
    return gate_up[0::2].contiguous(), gate_up[1::2].contiguous(), down


def expert_forward(layer: Mapping[str, torch.Tensor], e: int, x: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU of expert ``e``: x [..., H] → down(silu(gate x) ⊙ up x) [..., H].

    Computed in float32, or float64 when ``x`` is float64.
    """
    gate, up, down = dequantize_expert(layer, e)
    if x.shape[-1] != gate.shape[1]:
        raise HetquantError(
            f"expert_forward: x has {x.shape[-1]} features, expected {gate.shape[1]}"
        )
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt)
    act = torch.nn.functional.silu(x @ gate.to(dt).T) * (x @ up.to(dt).T)  # (..., I)
    return act @ down.to(dt).T  # (..., H)


def check_subpools(inter: int, num_subpools: int) -> None:
    """Raise unless ``num_subpools`` slices of ``inter`` are whole bytes of every down row."""
    n = num_subpools
    if n < 1 or inter % n or (inter // n) % 2:
        legal = [
            s for s in range(1, min(inter, 64) + 1) if inter % s == 0 and (inter // s) % 2 == 0
        ]
        raise HetquantError(
            f"{n} subpools cannot split moe intermediate {inter}; need I % S == 0 and I/S even, "
            f"so that each down slice is whole bytes — e.g. S in {legal}"
        )


def subpool_slice(
    layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int
) -> dict[str, torch.Tensor]:
    """Views of ``layer`` for subpool ``subpool`` of ``num_subpools`` (module docstring)."""
    _, _, inter = _layer_dims(layer)
    n = num_subpools
    check_subpools(inter, n)
    if not 0 <= subpool < n:
        raise HetquantError(f"subpool_slice: subpool {subpool} not in 0..{n - 1}")
    a, b = subpool * inter // n, (subpool + 1) * inter // n
    return {
        "gate_up_packed": layer["gate_up_packed"][:, 2 * a : 2 * b],  # (E, 2I/S, H/2)
        "gate_up_scale": layer["gate_up_scale"][:, 2 * a : 2 * b],  # (E, 2I/S)
        "down_packed": layer["down_packed"][:, :, a // 2 : b // 2],  # (E, H, I/2S)
        "down_scale": layer["down_scale"][:],  # (E, H), shared by all subpools
    }
