"""Block FP8 under DeepSeek's own tensor names: ``weight`` + ``scale`` (DeepSeek-V4's checkpoints).

The same E4M3 codes and 128×128 block multipliers as :mod:`fp8_block` (whose docstring gives the
exact dequantization), stored the way DeepSeek's own inference code names them — ``scale``, not the
Hugging Face ``weight_scale_inv`` — and, in DeepSeek-V4's FP4-expert releases, as UE8M0 bytes:

==========  ====================  =================================  ==================================
name        dtype                 shape                              meaning
==========  ====================  =================================  ==================================
``weight``  F8_E4M3               [out, in]                          E4M3 codes
``scale``   F8_E8M0 (or F32)      [ceil(out / 128), ceil(in / 128)]  block multiplier ``2^(byte - 127)``
==========  ====================  =================================  ==================================

Sources: vLLM 0.32 maps DeepSeek-V4's ``.scale`` to ``.weight_scale_inv``
(``vllm/models/deepseek_v4/cpu/model.py:808-817``) and reads the FP4 releases' linear scales as
``float8_e8m0fnu``, the FP8-expert ones (V4-Flash-Base) as float32
(``vllm/models/deepseek_v4/quant_config.py:81-84``). transformers 5.24 allocates the scale of an
FP8 linear as ``float8_e8m0fnu`` under ``scale_fmt: ue8m0`` (``integrations/finegrained_fp8.py``,
``_get_ue8m0_dtype``).

``scale_dtype`` is the variant: ``F8_E8M0`` (every scale a power of two by construction; byte 0xFF,
NaN, is refused) or ``F32`` (any positive finite multiplier, as :mod:`fp8_block`). Reading converts
the scale to F32 exactly and runs :class:`~.fp8_block.Fp8Block`'s validated, bit-exact code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ._lazy import torch
from .arrays import RowsInto
from .base import TensorMeta, register
from .errors import HetquantError
from .fp4_e2m1 import UE8M0_BIAS, UE8M0_NAN, check_ue8m0, ue8m0_to_f32
from .fp8_block import Fp8Block, scale_shape

__all__ = ["Fp8BlockScale"]

SCALE_DTYPES = ("F8_E8M0", "F32")


@dataclass(frozen=True)
class Fp8BlockScale(Fp8Block):
    """E4M3 weight + per-block ``scale`` (UE8M0 or F32) under DeepSeek's names (module docstring)."""

    name: ClassVar[str] = "fp8_block_scale"
    keys: ClassVar[frozenset[str]] = frozenset({"weight", "scale"})
    scale_dtype: str = "F8_E8M0"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale_dtype not in SCALE_DTYPES:
            raise HetquantError(
                f"fp8_block_scale: scale dtype {self.scale_dtype} is neither UE8M0 (F8_E8M0) nor "
                "F32; hetquant reads no other FP8 block scale"
            )

    # -- the stored form ---------------------------------------------------------------------

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Fp8BlockScale, tuple[int, int]]:
        if metas["weight"].dtype != "F8_E4M3":
            raise HetquantError(f"weight is {metas['weight'].dtype}, not F8_E4M3")
        as_v3 = {"weight": metas["weight"], "weight_scale_inv": metas["scale"]}
        base, shape = super().from_stored(as_v3)
        variant = dataclasses.replace(self, block=base.block, scale_dtype=metas["scale"].dtype)
        return variant, shape

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        return {
            "weight": TensorMeta("F8_E4M3", tuple(shape)),
            "scale": TensorMeta(self.scale_dtype, scale_shape(shape, self.block)),
        }

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"weight": (0, 1), "scale": (0, 1)}

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        """:class:`Fp8Block`'s quantization, the scale rounded UP to a power of two under UE8M0
        (so that ``|W / s| <= 448`` still holds) and stored as its byte."""
        if self.scale_dtype == "F32":
            out = super().quantize(weight, **options)
            return {"weight": out["weight"], "scale": out["weight_scale_inv"]}
        w = weight.to(torch.float32)
        n, k = w.shape
        b = self.block
        sr, sc = scale_shape((n, k), b)
        padded = torch.zeros(sr * b, sc * b)
        padded[:n, :k] = w
        amax = padded.reshape(sr, b, sc, b).abs().amax(dim=(1, 3))  # (sr, sc)
        mant, exp2 = torch.frexp(amax / 448.0)
        e = torch.where(mant == 0.5, exp2 - 1, exp2) + UE8M0_BIAS
        e = torch.where(amax > 0, e, torch.full_like(e, UE8M0_BIAS)).clamp(0, UE8M0_NAN - 1)
        s = ue8m0_to_f32(e.to(torch.uint8))
        full = s.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
        q = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return {"weight": q.contiguous(),
                "scale": e.to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()}  # fmt: skip

    # -- reading: the scale as F32, then fp8_block's code --------------------------------------

    def _v3(self, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = tensors["scale"]
        if self.scale_dtype == "F8_E8M0":
            check_ue8m0(f"{name}.scale", s)
            s = ue8m0_to_f32(s)
        return {"weight": tensors["weight"], "weight_scale_inv": s}

    def _base(self) -> Fp8Block:
        return Fp8Block(block=self.block, scale_fmt=self.scale_fmt)

    def source_rows(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        return self._base().source_rows(name, self._v3(name, tensors), shape)

    def _v3_arrays(self, name: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        s = arrays["scale"]
        if self.scale_dtype == "F8_E8M0":
            raw = s.view(np.uint8)
            if raw.size and int(raw.max()) == UE8M0_NAN:
                raise HetquantError(f"{name}.scale: NaN scale(s) (UE8M0 byte 0xFF); corrupt")
            s = np.ldexp(np.float32(1.0), raw.astype(np.int32) - UE8M0_BIAS).astype(np.float32)
        return {"weight": arrays["weight"], "weight_scale_inv": s}

    def source_row_arrays(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int],
        into: RowsInto | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:  # fmt: skip
        return self._base().source_row_arrays(name, self._v3_arrays(name, arrays), shape, into)

    def source_absmax_array(
        self, name: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, int]
    ) -> float:
        return self._base().source_absmax_array(name, self._v3_arrays(name, arrays), shape)

    def source_dequantized(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> torch.Tensor:
        return self._base().source_dequantized(name, self._v3(name, tensors), shape)

    def source_absmax(
        self, name: str, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]
    ) -> float:
        return self._base().source_absmax(name, self._v3(name, tensors), shape)

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._base().dequantize(self._v3("weight", tensors))


register(Fp8BlockScale())
