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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ._lazy import torch
from ._rows_native import int4_rows, int4_rows_array
from .arrays import NotNative, native
from .base import (
    ExpertLayerFormat,
    Streaming,
    TensorMeta,
    WeightFormat,
    all_finite,
    register,
    register_expert_format,
)
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .dtypes import divide, st_dtype
from .errors import HetquantError

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

QMAX = 7  # signed codes q ∈ [−QMAX, QMAX]
ZERO_POINT = 8  # stored code c = q + ZERO_POINT ∈ 1..15
CLIP_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))  # 1.00, 0.98, …, 0.70
LAYER_KEYS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


def _check_even(what: str, dim: str, n: int) -> None:
    if n <= 0 or n % 2:
        raise HetquantError(
            f"{what}: {dim} = {n} must be a positive even number; int4_cpu packs two "
            "elements per byte along it and never pads"
        )


def _check_weight(what: str, weight: torch.Tensor, finite: bool = True) -> torch.Tensor:
    """Validate a float weight [out, in] and return it as float32."""
    if weight.ndim != 2:
        raise HetquantError(f"{what}: expected a 2-D weight, got shape {list(weight.shape)}")
    _check_even(what, "in", weight.shape[1])
    w = weight.to(torch.float32)
    if finite and not all_finite(w):
        bad = int((~torch.isfinite(w)).sum())
        raise HetquantError(f"{what}: {bad} NaN/Inf values (or beyond float32); fix the source")
    return w


def _row_scale(amax: torch.Tensor, ratio: float) -> torch.Tensor:
    s = divide(amax * ratio, QMAX)  # (R,)
    return torch.where(amax > 0, s, torch.ones_like(s))


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = (w / scale[:, None]).round_().clamp_(-QMAX, QMAX)  # (R, K), half to even
    return q.add_(ZERO_POINT).to(torch.uint8)


def _dequant_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (codes.to(torch.float32) - ZERO_POINT) * scale.to(torch.float32).unsqueeze(-1)


def _sq_err(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # w − ŵ is exact in float32 (Sterbenz: ŵ = 0, or ŵ/2 ≤ w ≤ 2ŵ since ρ ≥ 1/2); squares are
    # exact in float64, so only the float64 sum rounds.
    diff = w - _dequant_codes(codes, scale)  # (R, K)
    return diff.double().square_().sum(-1)  # (R,)


def _quantize_rows(
    what: str, w: torch.Tensor, clip_search: bool = False, finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, K] (K even) → (packed U8 [R, K/2], scale F32 [R]): the fused kernel
    (``_rows_native.int4_rows``, the same bytes) without clip search, else the torch code."""
    fast = None if clip_search else int4_rows(w) if w.ndim == 2 else None
    if fast is not None:
        return fast
    return _quantize_rows_torch(_check_weight(what, w, finite), clip_search)


def _quantize_rows_torch(w: torch.Tensor, clip_search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 rows [R, K] (K even, finite) → (packed U8 [R, K/2], scale F32 [R])."""
    amax = w.abs().amax(dim=-1)  # (R,)
    if not all_finite(amax):
        raise HetquantError("int4_cpu: NaN/Inf values (or beyond float32); fix the source")
    scale = _row_scale(amax, CLIP_RATIOS[0])
    codes = _codes(w, scale)  # (R, K)
    if clip_search:
        err = _sq_err(w, codes, scale)
        for ratio in CLIP_RATIOS[1:]:
            s = _row_scale(amax, ratio)
            c = _codes(w, s)
            e = _sq_err(w, c, s)
            better = e < err  # strict: ties keep the larger ratio
            scale = torch.where(better, s, scale)
            codes = torch.where(better[:, None], c, codes)
            err = torch.where(better, e, err)
    return pack_nibbles_u8(codes), scale


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed U8 [..., R, K/2] and scale [..., R] → float32 [..., R, K]."""
    if not torch.isfinite(scale).all():
        raise HetquantError("int4_cpu: a scale is NaN/Inf; the file is corrupt")
    return _dequant_codes(unpack_nibbles_u8(packed), scale)


@dataclass(frozen=True)
class Int4Cpu(WeightFormat):
    """Symmetric INT4 with one F32 scale per output row (see module docstring)."""

    name: ClassVar[str] = "int4_cpu"
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
        _check_even(self.name, "in", inp)
        return {
            "weight_packed": TensorMeta("U8", (out, inp // 2)),
            "weight_scale": TensorMeta("F32", (out,)),
        }

    def quantize(
        self, weight: torch.Tensor, *, clip_search: bool = False, **options: Any
    ) -> dict[str, torch.Tensor]:
        if options:
            raise HetquantError(f"{self.name}.quantize: unknown options {sorted(options)}")
        packed, scale = _quantize_rows(f"{self.name}.quantize", weight, clip_search)
        return {"weight_packed": packed, "weight_scale": scale}

    def quantize_array(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`quantize` (RTN) of numpy rows (``arrays``), by the kernel alone."""
        packed, scale = native(int4_rows_array(rows), f"{self.name}: rows {rows.dtype}")
        return {"weight_packed": packed, "weight_scale": scale}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        packed = tensors.get("weight_packed")
        if packed is None or packed.ndim != 2:
            raise HetquantError(f"{self.name}: weight_packed missing or not 2-D")
        self.check_stored(tensors, (packed.shape[0], 2 * packed.shape[1]))
        return dequantize_rows(packed, tensors["weight_scale"])


def layer_stored(num_experts: int, hidden: int, inter: int) -> dict[str, TensorMeta]:
    """Names, dtypes and shapes of one MoE layer's stacked tensors (module docstring)."""
    if num_experts <= 0:
        raise HetquantError(f"int4_cpu layer: num_experts = {num_experts} must be positive")
    _check_even("int4_cpu layer", "hidden", hidden)
    _check_even("int4_cpu layer", "moe intermediate", inter)
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
        _check_even(f"quantize_expert: {what}", "in", w.shape[1])
    inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (hidden, inter):
        raise HetquantError(
            f"quantize_expert: gate {list(gate.shape)}, up {list(up.shape)}, down "
            f"{list(down.shape)}; expected gate = up = [I, H] and down = [H, I]"
        )
    _check_even("quantize_expert", "moe intermediate", inter)
    fast = None if clip_search else (int4_rows(gate, up), int4_rows(down))
    if fast is not None and None not in fast:  # the fused kernel, gate/up rows interleaved
        (gu_packed, gu_scale), (d_packed, d_scale) = fast  # type: ignore[misc]
    else:
        g, u, d = (_check_weight(f"quantize_expert: {n}", w) for n, w in (("gate", gate), ("up", up), ("down", down)))  # fmt: skip
        gu_packed, gu_scale = _quantize_rows_torch(interleave_rows(g, u), clip_search)  # (2I, H)
        d_packed, d_scale = _quantize_rows_torch(d, clip_search)
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
    num_experts = _layer_dims(layer)[0]
    if not 0 <= e < num_experts:
        raise HetquantError(f"dequantize_expert: expert {e} not in 0..{num_experts - 1}")
    gate_up = dequantize_rows(layer["gate_up_packed"][e], layer["gate_up_scale"][e])  # (2I, H)
    down = dequantize_rows(layer["down_packed"][e], layer["down_scale"][e])  # (H, I)
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


register(Int4Cpu())


@dataclass(frozen=True)
class Int4CpuExperts(ExpertLayerFormat):
    """The per-layer stacked layout above, as a registered expert-layer format."""

    name: ClassVar[str] = "int4_cpu_experts"
    streams_rows: ClassVar[bool] = True  # quantize_rows
    cpu_kernel: ClassVar[str | None] = "int4"  # runtime/kernels/int4_gemv.py, int4_moe.py
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
        return _quantize_rows("int4_cpu_experts", rows, self.clip_search, finite=False)

    def quantize_rows_array(
        self, a: np.ndarray, b: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`quantize_rows` of numpy rows ``a`` [R, K], or with ``b`` of ``a`` and ``b`` rows
        interleaved (row 2i from a, 2i + 1 from b: ``gate_up``), by the kernel alone."""
        if self.clip_search:
            raise NotNative("int4_cpu_experts: clip search has no kernel")
        return native(int4_rows_array(a, b), f"int4_cpu_experts: rows {a.dtype}")


register_expert_format(Int4CpuExperts())
