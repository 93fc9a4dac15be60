"""AutoAWQ GEMM W4A16: unsigned 4-bit codes with per-group FP16 scales and 4-bit zero points.

Stored tensors for a linear weight ``W`` of shape [N = out, K = in], group size ``g`` (128 or 64);
note the layout is *transposed* against ``nn.Linear.weight``:

==========  =====  ===============  =========================================================
name        dtype  shape            content
==========  =====  ===============  =========================================================
``qweight`` I32    [K, N / 8]       codes ``q[n, k]`` in 0..15; word ``[k, c]`` holds outputs
                                    ``8c .. 8c+7`` of input ``k``, interleaved (see below)
``qzeros``  I32    [K / g, N / 8]   zero points ``z[n, j]`` in 0..15, packed like ``qweight``
``scales``  F16    [K / g, N]       ``s[n, j]``, one per output channel and input group
==========  =====  ===============  =========================================================

Nibble order (AutoAWQ ``AWQ_ORDER``): bits ``4i .. 4i+3`` of each word hold output ``8c +
AWQ_ORDER[i]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``, i.e. from the low nibble up the
outputs +0, +2, +4, +6, +1, +3, +5, +7. Readers shift by ``4 * [0..7]`` and then index with
``AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)``. Zero points are stored as is (no GPTQ "-1").

Dequantization (AutoAWQ ``dequantize_gemm``; ``j = k // g``)::

    W[n, k] = (q[n, k] - z[n, j]) * f32(s[n, j])

computed in float32, where it is exact (AutoAWQ's fp16 reference rounds the product to fp16).

Round-to-nearest quantization follows AutoAWQ's ``pseudo_quantize_tensor`` (zero_point=True)::

    lo, hi = min(w_group), max(w_group)
    s = max(hi - lo, 1e-5) / 15;  z = clamp(-round(lo / s), 0, 15);  q = clamp(round(w / s) + z, 0, 15)

with two deliberate differences. ``[lo, hi]`` is widened to contain 0: a no-op for groups of both
signs (every real weight group), while for a group of one sign AutoAWQ's ``z`` leaves 0..15, is
clamped, and most codes saturate. ``s`` is rounded *up* to the next FP16 value instead of to the
nearest (at most one FP16 ulp apart), so ``|W - dequant(W)| <= s / 2`` holds for every element.

Sources: AutoAWQ 0.2.9 (``88e4c76``) ``awq/modules/linear/gemm.py`` (``WQLinear_GEMM``,
``from_linear``), ``awq/utils/packing_utils.py``, ``awq/quantize/quantizer.py``,
``awq/models/_config.py``; summarized in ``reference/awq_ct.md`` §1.2-1.3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import _quant_native
from ._lazy import torch
from .arrays import native
from .base import Streaming, TensorMeta, WeightFormat, all_finite, register
from .bits import unpack_nibbles_i32
from .dtypes import round_up_to
from .errors import HetquantError

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "GROUP_SIZES",
    "PACK",
    "QMAX",
    "AwqW4A16",
]

BITS = 4
PACK = 32 // BITS  # codes per int32 word
QMIN, QMAX = 0, 2**BITS - 1  # unsigned code range
RANGE_EPS = 1e-5  # AutoAWQ: (max - min).clamp(min=1e-5)
GROUP_SIZES = (128, 64)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i..4i+3 hold element AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # element j sits in nibble AWQ_REVERSE_ORDER[j]


@dataclass(frozen=True)
class AwqW4A16(WeightFormat):
    """AutoAWQ GEMM W4A16 with asymmetric per-group quantization (see module docstring)."""

    name: ClassVar[str] = "awq_w4a16"
    native_quantize: ClassVar[bool] = True  # quantize_array
    native_into: ClassVar[bool] = True  # quantize_array_into: chunks into their columns
    keys: ClassVar[frozenset[str]] = frozenset({"qweight", "qzeros", "scales"})
    group_size: int = 128

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[AwqW4A16, tuple[int, int]]:
        k, n = metas["qweight"].shape[0], metas["scales"].shape[1]  # qweight [K, N/8]
        group = k // metas["scales"].shape[0]
        return dataclasses.replace(self, group_size=group), (n, k)

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise HetquantError(
                f"awq_w4a16: group_size {self.group_size} is not supported; use one of "
                f"{list(GROUP_SIZES)}"
            )

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        # Stored transposed: weight rows (N) run along dim 1 of every tensor.
        return Streaming(self, {"qweight": 1, "qzeros": 1, "scales": 1})

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        # Transposed: out (N) runs along dim 1 (8 per word in qweight/qzeros), in (K) along
        # dim 0 (g per row of qzeros/scales), so a shard keeps whole words and whole groups.
        return dict.fromkeys(("qweight", "qzeros", "scales"), (1, 0))

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = self._check_shape(shape)
        groups = k // self.group_size
        return {
            "qweight": TensorMeta("I32", (k, n // PACK)),
            "qzeros": TensorMeta("I32", (groups, n // PACK)),
            "scales": TensorMeta("F16", (groups, n)),
        }

    def quantize(
        self,
        weight: torch.Tensor,
        *,
        scales: torch.Tensor | None = None,
        zeros: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Float weight [N, K] → stored tensors, round-to-nearest.

        ``scales`` and ``zeros`` (both or neither) hand over to :meth:`quantize_with`. BF16/F32
        weights on the CPU go through the fused C++ kernel (``_quant_native``), others through
        torch; both give the same bytes.
        """
        if scales is not None or zeros is not None:
            if scales is None or zeros is None:
                raise HetquantError("awq_w4a16.quantize: give both scales= and zeros=, or neither")
            return self.quantize_with(weight, scales, zeros)
        self._check_shape(tuple(weight.shape))
        native = _quant_native.awq_rtn(weight, self.group_size)  # None: not applicable, or bad
        return self._quantize_torch(weight) if native is None else native

    def quantize_array(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`quantize` (RTN) of numpy rows (``arrays``), by the kernel alone."""
        self._check_shape(rows.shape)
        out = _quant_native.awq_rtn_array(rows, self.group_size)
        return native(out, lambda: f"{self.name}: rows {rows.dtype}")

    def quantize_array_into(
        self, rows: np.ndarray, row0: int, out: dict[str, np.ndarray], **options: object
    ) -> dict[str, np.ndarray]:
        """Rows ``row0`` .. quantized (RTN) by the kernel straight into their columns of the
        whole weight's ``out`` (every key runs over the weight's rows along dim 1, so a chunk's
        part is a column block: the kernel writes it, no strided copy follows)."""
        self._check_shape(rows.shape)
        got = _quant_native.awq_rtn_array(rows, self.group_size, out=out, row0=row0)
        native(got, lambda: f"{self.name}: rows {row0}+ {rows.dtype}")
        return {}

    def _quantize_torch(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The round-to-nearest reference (module docstring)."""
        w = self._groups(weight, finite=False)  # (N, K/g, g)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/g); NaN/Inf propagate
        if not (all_finite(lo) and all_finite(hi)):
            self._groups(weight)  # raises
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # range widened to contain 0
        span = (hi.double() - lo.double()).clamp(min=RANGE_EPS)  # (N, K/g), float64
        s = _round_up_f16(span / QMAX, "scales")  # (N, K/g)
        z = (-torch.round(lo / s.float())).clamp(QMIN, QMAX)  # (N, K/g)
        return self._pack(w, s, z)

    def quantize_with(
        self, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Quantize ``weight`` [N, K] with given ``scales`` and ``zeros``, both [N, K/g].

        ``scales`` (positive, any float dtype) are rounded to FP16 as stored; ``zeros`` must hold
        integers in 0..15 (any dtype). Codes are ``clamp(round(w / s) + z, 0, 15)``.
        """
        w = self._groups(weight)  # (N, K/g, g)
        want = tuple(w.shape[:2])
        for tname, t in (("scales", scales), ("zeros", zeros)):
            if tuple(t.shape) != want:
                raise HetquantError(
                    f"awq_w4a16.quantize_with: {tname} has shape {list(t.shape)}, expected "
                    f"{list(want)} ([out, in / {self.group_size}], the weight's orientation)"
                )
        sf = scales.to(torch.float32)
        if not bool(torch.isfinite(sf).all()) or not bool((sf > 0).all()):
            raise HetquantError("awq_w4a16.quantize_with: scales must be finite and positive")
        s = scales.to(torch.float16)
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise HetquantError(
                "awq_w4a16.quantize_with: scales overflow FP16 or round to 0 in it; they must "
                f"lie within about 6e-8..{torch.finfo(torch.float16).max:g}"
            )
        z = zeros.to(torch.float32)
        if not bool((z == z.round()).all()) or not bool(((z >= QMIN) & (z <= QMAX)).all()):
            raise HetquantError(
                f"awq_w4a16.quantize_with: zeros must be integers in {QMIN}..{QMAX}"
            )
        return self._pack(w, s, z)

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        for key in ("qweight", "scales"):
            if key not in tensors:
                raise HetquantError(f"awq_w4a16: stored tensor {key!r} is missing")
        k, n = tensors["qweight"].shape[0], tensors["scales"].shape[-1]
        self.check_stored(tensors, (n, k))
        s = tensors["scales"].to(torch.float32)  # (K/g, N)
        if not bool(torch.isfinite(s).all()):
            raise HetquantError("awq_w4a16: scales contain NaN or Inf; the checkpoint is corrupt")
        q = unpack_nibbles_i32(tensors["qweight"], AWQ_ORDER).to(torch.float32)  # (K, N)
        z = unpack_nibbles_i32(tensors["qzeros"], AWQ_ORDER).to(torch.float32)  # (K/g, N)
        g = self.group_size
        w_t = (q - z.repeat_interleave(g, dim=0)) * s.repeat_interleave(g, dim=0)  # (K, N)
        return w_t.t().contiguous()  # (N, K)

    def quantization_config(self, modules_to_not_convert: Sequence[str] | None = None) -> dict:
        """The ``quantization_config`` AutoAWQ writes into config.json (``to_transformers_dict``).

        ``modules_to_not_convert`` holds name *substrings* of linears left unquantized; ``None``
        (AutoAWQ's default, written as JSON null) when there are none.
        """
        return {
            "quant_method": "awq",
            "zero_point": True,
            "group_size": self.group_size,
            "bits": BITS,
            "version": "gemm",
            "modules_to_not_convert": (
                None if modules_to_not_convert is None else list(modules_to_not_convert)
            ),
        }

    # -- helpers ---------------------------------------------------------------------------

    def _check_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        if len(shape) != 2:
            raise HetquantError(f"awq_w4a16: expected a 2-D weight [out, in], got {list(shape)}")
        n, k = int(shape[0]), int(shape[1])
        if n <= 0 or k <= 0 or n % PACK:
            raise HetquantError(
                f"awq_w4a16: weight [out={n}, in={k}]: out must be a positive multiple of {PACK} "
                "(8 outputs per int32 word) and in positive; keep this module unquantized instead"
            )
        if k % self.group_size:
            raise HetquantError(
                f"awq_w4a16: weight [out={n}, in={k}]: in is not divisible by group_size "
                f"{self.group_size}; use another group size or keep this module unquantized"
            )
        return n, k

    def _groups(self, weight: torch.Tensor, finite: bool = True) -> torch.Tensor:
        """Validated float32 view of ``weight`` [N, K] as (N, K/g, g)."""
        n, k = self._check_shape(tuple(weight.shape))
        w = weight.to(torch.float32)
        if finite and not all_finite(w):
            raise HetquantError(
                f"awq_w4a16: weight [{n}, {k}] contains NaN or Inf; refusing to quantize it"
            )
        return w.reshape(n, k // self.group_size, self.group_size)  # (N, K/g, g)

    def _pack(self, w: torch.Tensor, s16: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Codes from grouped ``w`` (N, K/g, g), FP16 ``s16`` and ``z`` (N, K/g) → stored dict."""
        n = w.shape[0]
        sf = s16.to(torch.float32)[..., None]  # (N, K/g, 1)
        q = (w / sf).round_().add_(z[..., None]).clamp_(QMIN, QMAX)  # (N, K/g, g)
        q = q.reshape(n, -1).to(torch.uint8)  # (N, K)
        return {
            "qweight": _pack_columns(q),  # (K, N/8)
            "qzeros": _pack_columns(z.to(torch.uint8)),
            "scales": s16.t().contiguous(),  # (K/g, N)
        }


def _pack_columns(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] → int32 [K, N/8] = ``pack_nibbles_i32(q.t(), AWQ_ORDER)``, without
    transposing the codes or gathering: byte j of a word holds rows AWQ_ORDER[2j] (low nibble)
    and AWQ_ORDER[2j+1] (high) of each group of 8, i.e. (0, 2), (4, 6), (1, 3), (5, 7)."""
    n, k = q.shape
    q8 = q.reshape(n // PACK, PACK, k)  # (N/8, 8, K)
    lo, hi = q8[:, list(AWQ_ORDER[0::2])], q8[:, list(AWQ_ORDER[1::2])]  # (N/8, 4, K) each
    out = torch.empty((k, n // PACK, PACK // 2), dtype=torch.uint8)  # (K, N/8, 4) bytes
    out.copy_((lo | (hi << 4)).permute(2, 0, 1))
    return out.view(torch.int32).squeeze(-1)  # (K, N/8)


def _round_up_f16(x: torch.Tensor, what: str) -> torch.Tensor:
    """``x`` (positive) rounded up to the next FP16 value, so that ``result >= x``."""
    y = round_up_to(x, "F16")
    if not bool(torch.isfinite(y).all()):
        raise HetquantError(
            f"awq_w4a16: {what} exceed the FP16 range ({torch.finfo(torch.float16).max:g}); "
            "the weight's values are far too large for this format"
        )
    return y


register(AwqW4A16())
