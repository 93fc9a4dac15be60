"""CPU expert-pool FP4: DeepSeek-V4's routed experts kept losslessly — E2M1 codes, UE8M0 per 32.

The CPU-pool layer layout of :mod:`.fp4_e2m1` (DeepSeek-V4's FP4 expert source), laid out as
:mod:`.int4_cpu_group` lays out INT4 (same keys, same gate/up row interleaving, same subpools), so
that the pool's code paths for layers and subpools apply; the bytes are DeepSeek's, unchanged:

==================  =======  ==================  =============================================
name                dtype    shape               content
==================  =======  ==================  =============================================
``gate_up_packed``  U8       [E, 2I, H/2]        E2M1 codes, input ``2j`` in the low nibble of
                                                 byte ``j``; row 2i = gate (w1) row i, 2i+1 = up
                                                 (w3) row i
``gate_up_scale``   F8_E8M0  [E, 2I, H/32]       ``2^(e − 127)`` per row and 32 inputs
``down_packed``     U8       [E, H, I/2]         down (w2), packed along I
``down_scale``      F8_E8M0  [E, H, I/32]        groups along I
==================  =======  ==================  =============================================

Dequantization is :mod:`.fp4_e2m1`'s, exact in float32. A layer's layout is told from the INT4
ones by its scale dtype (``from_stored``: F8_E8M0, not F32 / BF16); the pool then runs the
kernels its ``cpu_kernel`` names (``runtime/kernels/registry.py``).

Why an integer kernel is exact here: ``2·E2M1[c] ∈ {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}``
(:data:`.fp4_e2m1.E2M1_X2`, a 16-entry table of int8) and a group's scale is a power of two, so
with int8 activations ``q`` (one scale ``sx`` per token) a row's output is
``y = sx · Σ_g 2^(e_g − 128) · Σ_{k ∈ g} E2M1_X2[c_k] · q_k`` — per group an exact integer of at
most 32 · 12 · 127 < 2^16, then a power-of-two scaling; only the sum over groups rounds.
:func:`fp4_gemv_int8` is that computation in torch (the reference a native kernel must equal).

Subpools: subpool ``s`` of ``S`` owns the gate / up rows of the intermediate slice
``[s·I/S, (s+1)·I/S)`` (a multiple of 32, as :mod:`.int4_cpu_group` with g = 32) and the rows
``[⌊s·H/S⌋, ⌊(s+1)·H/S⌋)`` of ``down`` with all their inputs (``subpool_down = "rows"``): the pool
gathers every subpool's activations before the down projection, so each output is computed as
one pool computes it (int8 activations are rounded per token over the whole intermediate).

Made by :func:`expert_from_fp4` (``formats/expert_repack.py``): the source's ``weight`` bytes
viewed as U8 and its ``scale`` bytes, no value recomputed — so the hybrid recipe keeps
DeepSeek-V4's experts exactly (``quantize_expert`` exists for tests: it is ``fp4_e2m1``'s rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ._lazy import torch
from .base import ExpertLayerFormat, TensorMeta, register_expert_format
from .errors import HetquantError
from .fp4_e2m1 import E2M1_X2, GROUP, Fp4E2m1, check_ue8m0, ue8m0_to_f32, unpack_e2m1
from .int4_cpu import interleave_rows

__all__ = [
    "LAYER_KEYS",
    "Fp4CpuExperts",
    "dequantize_expert",
    "expert_from_fp4",
    "fp4_gemv_int8",
    "stack_experts",
]

LAYER_KEYS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")
_SOURCE = Fp4E2m1()
_NPART = 8  # fp4_gemv_int8: partial sums of the group terms (the native kernel's order)


def _linear(what: str, t: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``fp4_e2m1`` linear → (codes U8 [out, in/2], scale F8_E8M0 [out, in/32]), the same
    bytes (its stored form checked, NaN scales refused)."""
    if set(t) != {"weight", "scale"}:
        raise HetquantError(f"{what}: expected fp4_e2m1's weight and scale, got {sorted(t)}")
    w = t["weight"]
    try:
        code = "U8" if w.dtype == torch.uint8 else "I8"  # another dtype: check_stored names it
        Fp4E2m1(code_dtype=code).check_stored(t, (w.shape[0], 2 * w.shape[1]))
    except HetquantError as e:
        raise HetquantError(f"{what}: {e}") from None
    check_ue8m0(f"{what}.scale", t["scale"])
    return w.contiguous().view(torch.uint8), t["scale"].contiguous()


def expert_from_fp4(
    gate: Mapping[str, torch.Tensor],
    up: Mapping[str, torch.Tensor],
    down: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One expert's ``fp4_e2m1`` linears (w1 = gate, w3 = up [I, H]; w2 = down [H, I]) → its
    slices of the layer tensors. Lossless: bytes carried over (module docstring)."""
    gp, gs = _linear("expert_from_fp4: gate", gate)
    upk, us = _linear("expert_from_fp4: up", up)
    dp, ds = _linear("expert_from_fp4: down", down)
    inter, hidden = gp.shape[0], 2 * gp.shape[1]
    if upk.shape != gp.shape or tuple(dp.shape) != (hidden, inter // 2):
        raise HetquantError(
            f"expert_from_fp4: gate {[inter, hidden]}, up {[upk.shape[0], 2 * upk.shape[1]]}, "
            f"down {[dp.shape[0], 2 * dp.shape[1]]}; expected gate = up = [I, H], down = [H, I]"
        )
    return {
        "gate_up_packed": interleave_rows(gp, upk),  # (2I, H/2)
        "gate_up_scale": interleave_rows(gs.view(torch.uint8), us.view(torch.uint8)).view(
            torch.float8_e8m0fnu
        ),  # (2I, H/32)
        "down_packed": dp,  # (H, I/2)
        "down_scale": ds,  # (H, I/32)
    }


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes U8 [R, K/2] and scales [R, K/32] → float32 [R, K], exactly."""
    lut = torch.tensor(E2M1_X2, dtype=torch.float32) / 2
    values = lut[unpack_e2m1(packed).long()]  # (R, K)
    return values * ue8m0_to_f32(scale).repeat_interleave(GROUP, dim=1)


def dequantize_expert(
    layer: Mapping[str, torch.Tensor], e: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e`` of a layer → float32 gate [I, H], up [I, H], down [H, I], exactly (gate and
    up rows are interleaved in ``gate_up_*``: row 2i gate i, 2i + 1 up i)."""
    num_experts = layer["gate_up_packed"].shape[0]
    if not 0 <= e < num_experts:
        raise HetquantError(f"dequantize_expert: expert {e} not in 0..{num_experts - 1}")
    gate_up = dequantize_rows(layer["gate_up_packed"][e], layer["gate_up_scale"][e])  # (2I, H)
    down = dequantize_rows(layer["down_packed"][e], layer["down_scale"][e])  # (H, I)
    return gate_up[0::2].contiguous(), gate_up[1::2].contiguous(), down


def fp4_gemv_int8(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y = x · Wᵀ`` [T, N] for codes [N, K/2], scales [N, K/32] and activations [T, K] quantized
    to int8 per token (``sx = amax / 127`` in float32, ``q = round(x / sx)`` half to even): the
    integer computation of the module docstring — per 32-group ``g`` an exact int32 sum
    ``A_g = Σ E2M1_X2[c] · q``, times ``2^(e_g − 128)`` (exact in float64), summed in the order
    every native path of ``runtime/kernels/fp4_gemv.py`` keeps: group ``g`` is added to partial
    ``p[g mod 8]`` in increasing ``g``, then ``((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))``,
    times ``sx`` in float64, rounded once to float32 (a zero as +0). Only the float64 additions
    round; pinning their order is what makes the native kernel equal this bit for bit."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    if x.ndim != 2 or x.shape[1] != k or tuple(scale.shape) != (n, k // GROUP):
        raise HetquantError(
            f"fp4_gemv_int8: x {list(x.shape)}, codes [{n}, {k}], scale {list(scale.shape)}"
        )
    check_ue8m0("fp4_gemv_int8: scale", scale)
    xf = x.to(torch.float32)
    sx = xf.abs().amax(dim=1, keepdim=True) / 127  # (T, 1)
    q = torch.round(xf / torch.where(sx > 0, sx, torch.ones_like(sx))).to(torch.int32)  # (T, K)
    w = torch.tensor(E2M1_X2, dtype=torch.int32)[unpack_e2m1(packed).long()]  # (N, K) int
    groups = k // GROUP
    per_group = torch.einsum(
        "tgk,ngk->tng", q.view(-1, groups, GROUP), w.view(n, groups, GROUP)
    )  # (T, N, K/32), exact int32
    pow2 = ue8m0_to_f32(scale).double() / 2  # 2^(e − 128): the ×2 of the integer table undone
    terms = per_group.double() * pow2[None]  # (T, N, K/32), each exact
    terms = torch.nn.functional.pad(terms, (0, -groups % _NPART))  # +0.0: adds nothing
    p = torch.zeros(*terms.shape[:2], _NPART, dtype=torch.float64)
    for c in range(terms.shape[2] // _NPART):  # p[g mod 8] += term g, g increasing
        p += terms[..., _NPART * c : _NPART * (c + 1)]
    v = ((p[..., 0] + p[..., 4]) + (p[..., 2] + p[..., 6])) + (
        (p[..., 1] + p[..., 5]) + (p[..., 3] + p[..., 7])
    )  # (T, N)
    y = (v * sx.double()).to(torch.float32)
    return y + 0.0  # -0.0 → +0.0, as the native kernel stores a zero


def stack_experts(experts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-expert slices in expert order → the layer tensors."""
    if not experts:
        raise HetquantError("stack_experts: no experts given")
    return {k: torch.stack([x[k] for x in experts]) for k in LAYER_KEYS}


@dataclass(frozen=True)
class Fp4CpuExperts(ExpertLayerFormat):
    """The stacked layout above, as a registered expert-layer format."""

    name: ClassVar[str] = "fp4_cpu_experts"
    cpu_kernel: ClassVar[str | None] = "fp4_e2m1"  # runtime/kernels/fp4_gemv.py
    # the GEMV rounds each call's activations to int8 per token: a subpool owning a slice of
    # down's inputs would round its slice on its own; owning whole rows it computes one pool's
    subpool_down: ClassVar[str] = "rows"

    def stored(self, num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
        e, h, i = num_experts, hidden, inter
        if e <= 0 or h <= 0 or i <= 0 or h % GROUP or i % GROUP:
            raise HetquantError(
                f"fp4_cpu_experts: E {e}, hidden {h}, moe intermediate {i}: hidden and "
                f"intermediate must be positive multiples of {GROUP}"
            )
        return {
            "gate_up_packed": TensorMeta("U8", (e, 2 * i, h // 2)),
            "gate_up_scale": TensorMeta("F8_E8M0", (e, 2 * i, h // GROUP)),
            "down_packed": TensorMeta("U8", (e, h, i // 2)),
            "down_scale": TensorMeta("F8_E8M0", (e, h, i // GROUP)),
        }

    def quantize_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``fp4_e2m1``'s rounding of float gate, up [I, H] and down [H, I], then the repack."""
        return expert_from_fp4(*(_SOURCE.quantize(w) for w in (gate, up, down)))

    def linear_format(self) -> Fp4E2m1:
        """``fp4_e2m1``: each row of gate, up and down is stored as it would be alone."""
        return _SOURCE

    def from_stored(
        self, metas: Mapping[str, TensorMeta]
    ) -> tuple[Fp4CpuExperts, tuple[int, int, int]]:
        gu, down = metas["gate_up_packed"].shape, metas["down_packed"].shape
        if metas["gate_up_scale"].dtype != "F8_E8M0":
            raise HetquantError("not fp4_cpu_experts: its scales are UE8M0")
        return dataclasses.replace(self), (gu[0], 2 * gu[2], 2 * down[2])

    def check_subpools(self, inter: int, num_subpools: int) -> None:
        s = num_subpools
        if s < 1 or inter % s or (inter // s) % GROUP:
            legal = [n for n in range(1, inter // GROUP + 1) if inter % n == 0
                     and (inter // n) % GROUP == 0]  # fmt: skip
            raise HetquantError(
                f"{s} subpools cannot split moe intermediate {inter} into whole groups of "
                f"{GROUP}; legal subpool counts: {legal}"
            )

    def subpool_slice(
        self, layer: Mapping[str, torch.Tensor], subpool: int, num_subpools: int
    ) -> dict[str, torch.Tensor]:
        """Views of ``layer`` for subpool ``subpool`` of ``num_subpools`` (module docstring)."""
        inter = 2 * layer["down_packed"].shape[2]
        self.check_subpools(inter, num_subpools)
        if not 0 <= subpool < num_subpools:
            raise HetquantError(f"subpool_slice: subpool {subpool} not in 0..{num_subpools - 1}")
        a, b = subpool * inter // num_subpools, (subpool + 1) * inter // num_subpools
        hidden = layer["down_packed"].shape[1]
        c, d = subpool * hidden // num_subpools, (subpool + 1) * hidden // num_subpools
        return {
            "gate_up_packed": layer["gate_up_packed"][:, 2 * a : 2 * b],
            "gate_up_scale": layer["gate_up_scale"][:, 2 * a : 2 * b],
            "down_packed": layer["down_packed"][:, c:d],  # rows: ``subpool_down``
            "down_scale": layer["down_scale"][:, c:d],
        }


register_expert_format(Fp4CpuExperts())
