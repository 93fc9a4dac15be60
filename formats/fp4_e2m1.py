"""DeepSeek-V4's FP4 routed experts: E2M1 codes, two per byte, one UE8M0 scale per row per 32.

DeepSeek-V4-Flash / -Pro ship every routed expert linear ``layers.L.ffn.experts.E.w{1,2,3}`` in
this format (``quantization_config.expert_dtype: "fp4"``; V4 puts ``expert_dtype`` at the top of
config.json, V4.1 inside ``quantization_config``). Stored tensors for a weight [N = out, K = in]:

==========  =========  ===========  ================================================================
name        dtype      shape        content
==========  =========  ===========  ================================================================
``weight``  I8         [N, K / 2]   E2M1 codes; byte ``[n, j]`` holds input ``2j`` in its LOW nibble
                                    (bits 0..3) and input ``2j + 1`` in its HIGH nibble (bits 4..7)
``scale``   F8_E8M0    [N, K / 32]  ``e[n, g]``: the multiplier ``2^(e - 127)`` of inputs
                                    ``32g .. 32g + 31`` of row n; byte 0xFF is NaN
==========  =========  ===========  ================================================================

An E2M1 code ``c`` (4 bits) is ``sign = c >> 3``, ``exp = (c >> 1) & 3``, ``man = c & 1``:
``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` for ``c & 7 = 0..7`` (no Inf, no NaN; 0x8 is -0.0).
Dequantization, exact in float32 (a grid value times a power of two)::

    W[n, k] = E2M1[code(n, k)] * 2^(e[n, k // 32] - 127)

Primary sources (transformers 5.24): the nibble order and the value table are
``integrations/finegrained_fp8.py:1119-1128`` (``_FP4_E2M1_LUT``; ``low = u8 & 0xF`` is element
``2j``, ``high = u8 >> 4`` element ``2j + 1``); the storage (``int8``, K halved, per-row scales at
granularity 32, ue8m0 → ``float8_e8m0fnu``) is ``finegrained_fp8.py:748-760``; ``expert_dtype`` in
``quantization_config`` is ``utils/quantization_config.py:1700-1743`` and
``models/deepseek_v4/configuration_deepseek_v4.py:245-254``. vLLM 0.32 loads the same tensors as
``MXFP4`` (``vllm/models/deepseek_v4/quant_config.py:34``) from DeepSeek's names ``….w1.weight`` /
``….w1.scale`` (``vllm/models/deepseek_v4/cpu/model.py:808``), reading the scale bytes raw.

Because every scale is a power of two, ``2 · E2M1`` is an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8,
±12} (:data:`E2M1_X2`): a row's dot product with int8 activations is an exact integer sum per
32-group, scaled by ``2^(e - 128)`` — what the CPU expert format built on this one relies on.

Read as a source, a scale byte 0xFF (NaN) is refused, as is a scale so large that ``6 · 2^(e-127)``
overflows float32 (e ≥ 254 with a code of magnitude 6; the dequantized rows are checked for
Inf). A scale of another dtype (F32, BF16, U8: not UE8M0) fits no variant and names its dtype.

Quantization (to build test checkpoints as DeepSeek ships them): per 32-group,
``e = 127 + ceil(log2(amax / 6))`` (``e = 127`` for an all-zero group) and codes rounded to the
nearest E2M1 value of ``W / 2^(e-127)``, ties to the even code (``man = 0``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ._lazy import torch
from .base import TensorMeta, WeightFormat, register
from .errors import HetquantError

__all__ = [
    "E2M1",
    "E2M1_X2",
    "GROUP",
    "UE8M0_BIAS",
    "UE8M0_NAN",
    "Fp4E2m1",
    "check_ue8m0",
    "pack_e2m1",
    "unpack_e2m1",
]

GROUP = 32  # inputs per scale
UE8M0_BIAS = 127  # scale = 2^(byte - 127)
UE8M0_NAN = 0xFF
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_X2 = tuple(int(2 * v) for v in E2M1)  # the codes as integers: 2·E2M1 ∈ {0, ±1, …, ±12}
E2M1_MAX = 6.0
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes 0..6
SCALE_DTYPES = ("F8_E8M0",)
CODE_DTYPES = (
    "I8",
    "U8",
)  # DeepSeek ships I8; kt-kernel 0.7.2 also reads U8 (sft/deepseek_v4.py:157)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """I8 [..., K/2] → codes U8 [..., K] (0..15), input ``2j`` from the low nibble."""
    u8 = packed.view(torch.uint8)
    return torch.stack((u8 & 0xF, u8 >> 4), dim=-1).reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K] (0..15, K even) → I8 [..., K/2]: :func:`unpack_e2m1`'s inverse."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).view(torch.int8)


def check_ue8m0(name: str, scale: torch.Tensor) -> None:
    """Refuse NaN scale bytes (0xFF: UE8M0 has no other special value)."""
    raw = scale.view(torch.uint8)
    if raw.numel() and int(raw.max()) == UE8M0_NAN:
        bad = int((raw == UE8M0_NAN).sum())
        raise HetquantError(
            f"{name}: {bad} NaN scale(s) (UE8M0 byte 0xFF) in the FP4 expert; the checkpoint is "
            "corrupt"
        )


def ue8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes → float32 ``2^(e - 127)``, exactly (e = 0 is the subnormal 2^-127)."""
    e = scale.view(torch.uint8).to(torch.int32)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - UE8M0_BIAS)


@dataclass(frozen=True)
class Fp4E2m1(WeightFormat):
    """DeepSeek-V4's FP4 expert weight: E2M1 codes + UE8M0 per row per 32 (module docstring)."""

    name: ClassVar[str] = "fp4_e2m1"
    keys: ClassVar[frozenset[str]] = frozenset({"weight", "scale"})
    scale_dtype: str = "F8_E8M0"
    code_dtype: str = "I8"

    def __post_init__(self) -> None:
        if self.code_dtype not in CODE_DTYPES:
            raise HetquantError(f"fp4_e2m1: codes stored as {self.code_dtype}, not I8 / U8")
        if self.scale_dtype not in SCALE_DTYPES:
            raise HetquantError(
                f"fp4_e2m1: scale dtype {self.scale_dtype} is not UE8M0 (F8_E8M0); DeepSeek-V4's "
                "FP4 experts carry ue8m0 scales and hetquant reads no other"
            )

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[Fp4E2m1, tuple[int, int]]:
        w = metas["weight"]
        if w.dtype not in CODE_DTYPES or len(w.shape) != 2:
            raise HetquantError(f"weight is {w.dtype}{list(w.shape)}, not I8 packed E2M1 codes")
        variant = dataclasses.replace(self, scale_dtype=metas["scale"].dtype, code_dtype=w.dtype)
        return variant, (w.shape[0], 2 * w.shape[1])

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = shape
        if n <= 0 or k <= 0 or k % GROUP:
            raise HetquantError(
                f"fp4_e2m1: weight [out={n}, in={k}]: in must be a positive multiple of {GROUP} "
                "(one UE8M0 scale per 32 inputs)"
            )
        return {
            "weight": TensorMeta(self.code_dtype, (n, k // 2)),
            "scale": TensorMeta(self.scale_dtype, (n, k // GROUP)),
        }

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"weight": (0, 1), "scale": (0, 1)}

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        """Float weight [N, K] → codes and scales (module docstring; for building tests)."""
        n, k = weight.shape
        self.stored((n, k))
        w = weight.to(torch.float32).reshape(n, k // GROUP, GROUP)  # (N, K/32, 32)
        if not bool(torch.isfinite(w).all()):
            raise HetquantError("fp4_e2m1.quantize: the weight holds NaN/Inf")
        amax = w.abs().amax(dim=-1)  # (N, K/32)
        _, exp2 = torch.frexp(amax / E2M1_MAX)  # amax/6 = m · 2^exp2, m in [0.5, 1)
        pow2 = torch.where(amax / E2M1_MAX == torch.ldexp(torch.ones_like(amax), exp2 - 1),
                           exp2 - 1, exp2)  # fmt: skip
        e = torch.where(amax > 0, pow2 + UE8M0_BIAS, torch.full_like(pow2, UE8M0_BIAS))
        if int(e.min()) < 0 or int(e.max()) > 253:
            raise HetquantError("fp4_e2m1.quantize: a group's scale leaves the UE8M0 range")
        x = w / ue8m0_to_f32(e.to(torch.uint8))[..., None]  # |x| <= 6
        codes = _nearest_code(x).reshape(n, k)
        packed = pack_e2m1(codes)
        packed = packed.view(torch.uint8) if self.code_dtype == "U8" else packed
        return {"weight": packed.contiguous(),
                "scale": e.to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()}  # fmt: skip

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        w, s = tensors["weight"], tensors["scale"]
        n, k2 = w.shape
        self.check_stored(tensors, (n, 2 * k2))
        check_ue8m0("scale", s)
        lut = torch.tensor(E2M1, dtype=torch.float32)
        values = lut[unpack_e2m1(w).long()]  # (N, K)
        return values * ue8m0_to_f32(s).repeat_interleave(GROUP, dim=1)  # (N, K), exact


def _nearest_code(x: torch.Tensor) -> torch.Tensor:
    """|x| ≤ 6 → the E2M1 code of the nearest value, ties to the even code."""
    mag = x.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32)
    low = torch.bucketize(mag, mids, right=False)  # a tie goes to the smaller magnitude
    high = torch.bucketize(mag, mids, right=True)  # a tie goes to the larger one
    idx = torch.where(low % 2 == 0, low, high)  # differ only at a tie: take the even one
    sign = torch.signbit(x)  # -0.0 and values rounding to it keep code 8
    return (idx + 8 * sign).to(torch.uint8)


register(Fp4E2m1())
