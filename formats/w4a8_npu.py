"""Ascend W4A8_DYNAMIC: int4 weights packed in pairs along the output dim, per-channel scales, as
msModelSlim's ascendV1 saver writes them (description ``version`` 1.0.0) and vllm-ascend reads them.

Stored tensors for a linear weight W [n, k] = [out, in] (n even; k a multiple of ``bias_chunks``):

=================  =====  ========  ==============================================================
name               dtype  shape     value
=================  =====  ========  ==============================================================
``weight``         I8     [n/2, k]  codes q ∈ [-8, 7] packed along ``out``: byte [j, c] =
                                    ``(q[2j+1, c] << 4) | (q[2j, c] & 0xF)``; the even row in the
                                    low nibble, both nibbles 4-bit two's complement
``weight_scale``   F32    [n, 1]    s = max(rowmax|W| / 7, FLT_EPSILON)
``weight_offset``  F32    [n, 1]    0 (symmetric)
``scale_bias``     F32    [n, c]    8 · Σ_{k' ∈ chunk j} q[n, k'] · s[n], c = ``bias_chunks``:
                                    1 (column-parallel linears: gate/up) or 16 (row-parallel
                                    ones: down), chunk j = columns [j·k/c, (j+1)·k/c)
=================  =====  ========  ==============================================================

Round to nearest: ``q = clamp(round_half_even(W / s), -8, 7)``; |W / s| <= 7, so the clamp never
bites and ``|W - dequant| <= s / 2``. Dequantization (msModelSlim's convention)::

    W[n, k] ≈ (q[n, k] - weight_offset[n]) · weight_scale[n]        # in float32

``scale_bias`` is derived data: ``8 · s · Σq`` is exact in float64 (Σq an integer of at most 17
bits, s an F32) and rounded once to F32 (msModelSlim sums F32 products: it may differ in the last
bit). vllm-ascend sums its columns per expert at load and hands the result to its grouped-matmul
kernels as ``bias`` / ``weight_assist_matrix``; what the kernel does with it is not documented.
Nothing here depends on it but :func:`check_scale_bias`.

The description entries of every stored tensor are ``W4A8_DYNAMIC``; the description must say
``"version": "1.0.0"`` (packed layout) and ``"group_size": 0`` (per channel; vllm-ascend assumes
256 and a per-group layout when the key is absent).

Sources (msModelSlim 26.1.0 wheel, vllm-ascend 0.23.0.post1 sdist):

- msModelSlim ``core/quant_service/modelslim_v1/save/ascendv1.py:423-438`` (``on_w4a8_dynamic``:
  the four tensors, F32, ``scale_bias = process_scale(prefix, q·s, 16)``), ``save/utils/pack.py``
  ``:25-68`` (``w4a8_pack_int4``: transpose, pair consecutive output rows, ``(w1 << 4) | (w0 &
  0xF)``, transpose back) and ``:71-90`` (``process_scale``: ``8·Σ`` over the row for
  gate/up/q/k/v, over 16 chunks of the row for down/o), ``ir/api/impl/int_quantization.py:41-89``
  (symmetric int4: ``max(-min, max) / 7`` floored at FLT_EPSILON) and ``:130-155`` (round half to
  even, clamp to [-8, 7]); its 26.1.0 W4A8 saver is per-channel only.
- vllm-ascend ``quantization/methods/w4a8.py``: version ``"1.0.0"`` selects the packed layout and
  ``group_size`` 0 per-channel (:347-356); MoE parameters ``w13_weight`` I8 [E, I, H],
  ``w2_weight`` I8 [E, H/2, I], scales/offsets F32 [E, ·, 1], ``w13_scale_bias`` F32 [E, 2I, 1],
  ``w2_scale_bias`` F32 [E, H, 16/tp] (:400-485); TP > 16 refused (:366-367); scales viewed as
  uint32 → int64, exact (:595-601); scale_bias summed over its chunks (:628-631); the packed int8
  viewed as int32 (:638-644), which equals torch_npu's int4pack (reference §3).

Not written: the per-group variant vllm-ascend also reads (``weight_scale_second`` /
``weight_offset_second`` [n, k/g], group scales rounded to FP16 at load, :595-626), which
msModelSlim 26.1.0 does not produce. Not verified on hardware: anything about the kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from ._lazy import torch
from .base import TensorMeta, WeightFormat, all_finite, register
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .errors import HetquantError

__all__ = [
    "BIAS_CHUNKS",
    "QMAX",
    "QMIN",
    "SCALE_FLOOR",
    "W4A8Dynamic",
    "check_scale_bias",
    "pack_out_pairs",
    "scale_bias",
    "unpack_out_pairs",
]

QMIN, QMAX = -8, 7
BIAS_CHUNKS = (1, 16)  # msModelSlim process_scale: column-parallel 1, row-parallel 16 (tp_num)
SCALE_FLOOR = 2.0**-23  # float32's machine epsilon
_WEIGHT_AXES: dict[str, tuple[int | None, int | None]] = {
    "weight": (0, 1),  # unit: two rows per packed row
    "weight_scale": (0, None),
    "weight_offset": (0, None),
    "scale_bias": (0, None),  # a shard's is recomputed from its own codes (shard_fixup)
}


def pack_out_pairs(q: torch.Tensor) -> torch.Tensor:
    """Signed codes [n, k] (-8..7) → I8 [n/2, k]: rows 2j and 2j+1 share byte row j, 2j low."""
    if q.shape[0] % 2:
        raise HetquantError(f"w4a8_dynamic: {q.shape[0]} rows do not pack in pairs; need even")
    nib = (q.to(torch.int16) & 0xF).T.contiguous()  # (k, n): pairs along the last dim
    return pack_nibbles_u8(nib).T.contiguous().view(torch.int8)  # (n/2, k)


def unpack_out_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_out_pairs`: I8 [n/2, k] → signed codes I8 [n, k]."""
    u = unpack_nibbles_u8(packed.view(torch.uint8).T.contiguous()).T  # (n, k), 0..15
    return (u.to(torch.int16) - 16 * (u >= 8).to(torch.int16)).to(torch.int8).contiguous()


def scale_bias(q: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """``8 · Σ q · s`` over ``chunks`` equal column chunks: q I8 [n, k], scale [n, 1] → F32 [n, c]."""
    n, k = q.shape
    if chunks not in BIAS_CHUNKS or k % chunks:
        raise HetquantError(
            f"w4a8_dynamic: in_features {k} does not split into {chunks} scale_bias chunks; "
            f"bias_chunks is one of {list(BIAS_CHUNKS)} and must divide in_features"
        )
    sums = q.to(torch.int64).reshape(n, chunks, k // chunks).sum(dim=-1)  # (n, c), exact
    return (8.0 * sums.to(torch.float64) * scale.to(torch.float64)).to(torch.float32)


def check_scale_bias(tensors: Mapping[str, torch.Tensor], chunks: int) -> None:
    """Raise unless ``scale_bias`` is what the codes and scales make (a corrupt artifact)."""
    q = unpack_out_pairs(tensors["weight"])
    want = scale_bias(q, tensors["weight_scale"], chunks)
    if not torch.equal(tensors["scale_bias"], want):
        bad = int((tensors["scale_bias"] != want).sum())
        raise HetquantError(
            f"w4a8_dynamic: scale_bias disagrees with the codes and scales in {bad} entries"
        )


@dataclass(frozen=True)
class W4A8Dynamic(WeightFormat):
    """W4A8_DYNAMIC, description version 1.0.0, per channel (see the module docstring)."""

    name: ClassVar[str] = "w4a8_dynamic"
    keys: ClassVar[frozenset[str]] = frozenset(
        {"weight", "weight_scale", "weight_offset", "scale_bias"}
    )
    bias_chunks: int = 1  # 1: column-parallel linear (gate/up), 16: row-parallel (down)

    def __post_init__(self) -> None:
        if self.bias_chunks not in BIAS_CHUNKS:
            raise HetquantError(
                f"w4a8_dynamic: bias_chunks {self.bias_chunks!r} is not one of {list(BIAS_CHUNKS)}"
            )

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[W4A8Dynamic, tuple[int, int]]:
        half, k = metas["weight"].shape
        variant = dataclasses.replace(self, bias_chunks=metas["scale_bias"].shape[1])
        return variant, (2 * half, k)

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = self._check_shape(shape)
        return {
            "weight": TensorMeta("I8", (n // 2, k)),
            "weight_scale": TensorMeta("F32", (n, 1)),
            "weight_offset": TensorMeta("F32", (n, 1)),
            "scale_bias": TensorMeta("F32", (n, self.bias_chunks)),
        }

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return dict(_WEIGHT_AXES)

    def shard_fixup(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_range: tuple[int, int],
        in_range: tuple[int, int],
    ) -> dict[str, torch.Tensor]:
        """A shard's ``scale_bias`` is its own: ``8 · Σ q · s`` over its columns' chunks."""
        out = dict(tensors)
        self._check_shape((out_range[1] - out_range[0], in_range[1] - in_range[0]))
        q = unpack_out_pairs(tensors["weight"])
        out["scale_bias"] = scale_bias(q, tensors["weight_scale"], self.bias_chunks)
        return out

    def quantize(self, weight: torch.Tensor, *, name: str = "weight") -> dict[str, torch.Tensor]:
        """Float weight [n, k] → stored tensors, symmetric round-to-nearest per row.

        ``name`` (the tensor's full name) prefixes error messages.
        """
        if weight.ndim != 2 or not weight.is_floating_point():
            raise HetquantError(
                f"{name}: w4a8_dynamic quantizes a float 2-D weight [out, in], got "
                f"{weight.dtype} {list(weight.shape)}"
            )
        try:
            self._check_shape(tuple(weight.shape))
        except HetquantError as e:
            raise HetquantError(f"{name}: {e}") from None
        w = weight.to(torch.float32)  # (n, k)
        if not all_finite(w):
            raise HetquantError(f"{name}: NaN/Inf in the weight; the source is corrupt")
        s = (w.abs().amax(dim=1, keepdim=True) / QMAX).clamp(min=SCALE_FLOOR)  # (n, 1)
        q = (w / s).round_().clamp_(QMIN, QMAX).to(torch.int8)  # (n, k)
        return {
            "weight": pack_out_pairs(q),
            "weight_scale": s,
            "weight_offset": torch.zeros_like(s),
            "scale_bias": scale_bias(q, s, self.bias_chunks),
        }

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "weight" not in tensors or tensors["weight"].ndim != 2:
            raise HetquantError(f"w4a8_dynamic: no 2-D 'weight' among {sorted(tensors)}")
        half, k = tensors["weight"].shape
        self.check_stored(tensors, (2 * half, k))
        q = unpack_out_pairs(tensors["weight"]).to(torch.float32)  # (n, k)
        return (q - tensors["weight_offset"]) * tensors["weight_scale"]  # (n, k)

    def _check_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        if len(shape) != 2 or min(shape) <= 0:
            raise HetquantError(f"w4a8_dynamic: stores 2-D weights [out, in], got {list(shape)}")
        n, k = int(shape[0]), int(shape[1])
        why = ["out must be even (int4 pairs along out)"] if n % 2 else []
        if k % self.bias_chunks:
            why.append(f"in must be a multiple of {self.bias_chunks} (scale_bias chunks)")
        if why:
            raise HetquantError(
                f"w4a8_dynamic: weight [out={n}, in={k}] does not pack: {'; '.join(why)}; "
                "keep this module in another format"
            )
        return n, k


register(W4A8Dynamic())
