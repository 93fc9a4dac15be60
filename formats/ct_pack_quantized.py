"""compressed-tensors ``pack-quantized`` W4A16, symmetric, per-group: read and write.

Kimi-K2-Thinking ships its routed experts in this format (group 32); llm-compressor's ``W4A16``
preset writes it with group 128. Stored tensors for a linear weight ``W`` of shape [N = out, K = in],
group size ``g`` (32 or 128), in the ``nn.Linear`` orientation:

=================  ======  =============  ======================================================
name               dtype   shape          content
=================  ======  =============  ======================================================
``weight_packed``  I32     [N, K / 8]     ``q[n, k] + 8`` (``q`` signed, -8..7); word ``[n, c]``
                                          holds inputs ``8c .. 8c+7``, input ``8c + i`` at bits
                                          ``4i .. 4i+3`` (plain little-endian nibble order)
``weight_scale``   BF16    [N, K / g]     ``s[n, j]``, one per output channel and input group
``weight_shape``   I64     [2]            ``(N, K)``
=================  ======  =============  ======================================================

No ``weight_zero_point`` (symmetric checkpoints drop it) and no ``weight_g_idx`` (no act-order);
checkpoints that carry either are refused. Dequantization (``j = k // g``)::

    W[n, k] = q[n, k] * f32(s[n, j])            # exact in float32

Reading does not depend on how the codes were chosen (Kimi's QAT reportedly uses only -7..7).

Dtype choices, where the sources differ: compressed-tensors writes ``weight_shape`` with
``torch.tensor(weight.shape)``, i.e. I64, and vLLM declares it int64, so I64 is written; the
vllm-ascend docstring lists Kimi-K2-Thinking's as int32, so ``shape_dtype="I32"`` reads (and
checks) such files. ``weight_scale`` takes the dtype of the observed weight — BF16 for DeepSeek and
Kimi — so BF16 is the default and ``scale_dtype`` selects F16 / F32.

Round-to-nearest quantization follows compressed-tensors ``calculate_qparams`` (symmetric)::

    s = max(absmax(w_group) / 7.5, eps_f32);  q = clamp(round(w / s), -8, 7)

except that ``s`` is rounded *up* to the scale dtype rather than to nearest, so that
``|W - dequant(W)| <= s / 2`` holds exactly (``absmax / s <= 7.5``; 7.5 rounds to 8 and clamps to
7, an error of exactly ``s / 2``).

Sources: compressed-tensors ``compressors/pack_quantized`` (``pack_to_int32``,
``unpack_from_int32``, ``compress``), ``quantization/utils/helpers.py::calculate_qparams``,
``quantization/quant_config.py``; vllm-ascend ``quantization/methods/w4a16.py``; vLLM
``compressed_tensors_wNa16.py``; summarized in ``reference/awq_ct.md`` §2.5, §2.7, §3.3, §3.5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ._lazy import torch
from .base import Streaming, TensorMeta, WeightFormat, register
from .bits import pack_nibbles_i32, unpack_nibbles_i32
from .dtypes import round_up_to, st_dtype, torch_dtype
from .errors import HetquantError

__all__ = ["GROUP_SIZES", "OFFSET", "PACK", "QMAX", "QMIN", "CtPackQuantized"]

BITS = 4
PACK = 32 // BITS  # codes per int32 word
QMIN, QMAX = -(2 ** (BITS - 1)), 2 ** (BITS - 1) - 1  # signed code range -8..7
OFFSET = 2 ** (BITS - 1)  # stored nibble = q + 8
HALF_RANGE = (2**BITS - 1) / 2  # 7.5: compressed-tensors' symmetric divisor (bit_range / 2)
SCALE_EPS = 2.0**-23  # float32's epsilon: compressed-tensors clamps scales to this
GROUP_SIZES = (128, 32)
SCALE_DTYPES = ("BF16", "F16", "F32")
SHAPE_DTYPES = ("I64", "I32")
_UNSUPPORTED = {
    "weight_zero_point": "asymmetric pack-quantized checkpoints are not supported",
    "weight_g_idx": "act-order (weight_g_idx) checkpoints are not supported",
}


@dataclass(frozen=True)
class CtPackQuantized(WeightFormat):
    """compressed-tensors pack-quantized W4A16, symmetric per-group (see module docstring)."""

    name: ClassVar[str] = "ct_pack_quantized"
    keys: ClassVar[frozenset[str]] = frozenset({"weight_packed", "weight_scale", "weight_shape"})
    group_size: int = 128
    scale_dtype: str = "BF16"
    shape_dtype: str = "I64"

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("group_size", self.group_size, GROUP_SIZES),
            ("scale_dtype", self.scale_dtype, SCALE_DTYPES),
            ("shape_dtype", self.shape_dtype, SHAPE_DTYPES),
        ):
            if value not in allowed:
                raise HetquantError(
                    f"ct_pack_quantized: {field} {value!r} is not supported; use one of "
                    f"{list(allowed)}"
                )

    def from_stored(
        self, metas: Mapping[str, TensorMeta]
    ) -> tuple[CtPackQuantized, tuple[int, int]]:
        n, k = metas["weight_packed"].shape[0], PACK * metas["weight_packed"].shape[1]
        variant = dataclasses.replace(
            self,
            group_size=k // metas["weight_scale"].shape[1],
            scale_dtype=metas["weight_scale"].dtype,
            shape_dtype=metas["weight_shape"].dtype,
        )
        return variant, (n, k)

    def streaming(self, shape: tuple[int, int]) -> Streaming:
        def finish(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            full = torch.tensor(shape, dtype=torch_dtype(self.shape_dtype))  # chunks saw (r, K)
            return {**stored, "weight_shape": full}

        axes = {"weight_packed": 0, "weight_scale": 0, "weight_shape": None}
        return Streaming(self, axes, finish=finish)

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"weight_packed": (0, 1), "weight_scale": (0, 1), "weight_shape": (None, None)}

    def shard_fixup(
        self,
        tensors: Mapping[str, torch.Tensor],
        out_range: tuple[int, int],
        in_range: tuple[int, int],
    ) -> dict[str, torch.Tensor]:
        """``weight_shape`` of a shard is the shard's own (out, in)."""
        out = dict(tensors)
        shard = (out_range[1] - out_range[0], in_range[1] - in_range[0])
        out["weight_shape"] = tensors["weight_shape"].new_tensor(shard)
        return out

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        n, k = self._check_shape(shape)
        return {
            "weight_packed": TensorMeta("I32", (n, k // PACK)),
            "weight_scale": TensorMeta(self.scale_dtype, (n, k // self.group_size)),
            "weight_shape": TensorMeta(self.shape_dtype, (2,)),
        }

    def quantize(
        self, weight: torch.Tensor, *, scales: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Float weight [N, K] → stored tensors, symmetric round-to-nearest.

        ``scales`` [N, K/g] (positive), when given, replace the computed ones (e.g. from a search).
        """
        w = self._groups(weight)  # (N, K/g, g)
        if scales is not None:
            s = self._given_scales(scales, tuple(w.shape[:2]))
        else:
            absmax = w.abs().amax(dim=-1)  # (N, K/g)
            s = self._round_up((absmax.double() / HALF_RANGE).clamp(min=SCALE_EPS))
        q = torch.round(w / s.to(torch.float32)[..., None]).clamp(QMIN, QMAX)  # (N, K/g, g)
        codes = (q.reshape(w.shape[0], -1) + OFFSET).to(torch.uint8)  # (N, K), 0..15
        return {
            "weight_packed": pack_nibbles_i32(codes).contiguous(),  # (N, K/8)
            "weight_scale": s.contiguous(),  # (N, K/g)
            "weight_shape": torch.tensor(tuple(weight.shape), dtype=torch_dtype(self.shape_dtype)),
        }

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        for key, why in _UNSUPPORTED.items():
            if key in tensors:
                raise HetquantError(f"ct_pack_quantized: {key} present: {why}")
        n, k = self._read_shape(tensors)
        self.check_stored(tensors, (n, k))
        s = tensors["weight_scale"].to(torch.float32)  # (N, K/g)
        if not bool(torch.isfinite(s).all()):
            raise HetquantError(
                "ct_pack_quantized: weight_scale contains NaN or Inf; the checkpoint is corrupt"
            )
        q = unpack_nibbles_i32(tensors["weight_packed"]).to(torch.float32) - OFFSET  # (N, K)
        return q * s.repeat_interleave(self.group_size, dim=1)  # (N, K)

    def quantization_config(
        self, ignore: Sequence[str] = ("lm_head",), targets: Sequence[str] = ("Linear",)
    ) -> dict:
        """The ``quantization_config`` compressed-tensors writes into config.json for this format.

        ``ignore``: exact module names or ``re:`` regexes left unquantized; ``targets``: module
        classes or names the group applies to. vllm-ascend's W4A16 MoE path reads a top-level
        ``group_size`` and assumes 32 without it (``reference/awq_ct.md`` §3.5); callers
        targeting it with group 128 add that key themselves.
        """
        weights = {
            "num_bits": BITS,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": self.group_size,
            "dynamic": False,
            "actorder": None,
            "block_structure": None,
            "observer": "minmax",
            "observer_kwargs": {},
        }
        group = {
            "targets": list(targets),
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(ignore),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    # -- helpers ---------------------------------------------------------------------------

    def _check_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        if len(shape) != 2:
            raise HetquantError(
                f"ct_pack_quantized: expected a 2-D weight [out, in], got {list(shape)}"
            )
        n, k = int(shape[0]), int(shape[1])
        if n <= 0 or k <= 0 or k % self.group_size:
            raise HetquantError(
                f"ct_pack_quantized: weight [out={n}, in={k}]: in must be a positive multiple "
                f"of group_size {self.group_size} (out positive); the format takes group_size "
                f"{' or '.join(map(str, sorted(GROUP_SIZES)))}: use another that divides {k}, or "
                "keep this module unquantized"
            )
        return n, k

    def _read_shape(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        if "weight_shape" not in tensors:
            raise HetquantError("ct_pack_quantized: stored tensor 'weight_shape' is missing")
        ws = tensors["weight_shape"]
        if ws.dtype.is_floating_point or ws.dtype == torch.bool or tuple(ws.shape) != (2,):
            raise HetquantError(
                f"ct_pack_quantized: weight_shape must be an integer tensor [2] = (out, in), got "
                f"{ws.dtype} {list(ws.shape)}"
            )
        if st_dtype(ws.dtype) != self.shape_dtype:
            raise HetquantError(
                f"ct_pack_quantized: weight_shape is {st_dtype(ws.dtype)}, this variant expects "
                f"{self.shape_dtype}; read it with get_format('ct_pack_quantized', "
                f"shape_dtype={st_dtype(ws.dtype)!r}, ...)"
            )
        n, k = (int(v) for v in ws.tolist())
        return self._check_shape((n, k))

    def _groups(self, weight: torch.Tensor) -> torch.Tensor:
        """Validated float32 view of ``weight`` [N, K] as (N, K/g, g)."""
        n, k = self._check_shape(tuple(weight.shape))
        w = weight.to(torch.float32)
        if not bool(torch.isfinite(w).all()):
            raise HetquantError(
                f"ct_pack_quantized: weight [{n}, {k}] contains NaN or Inf; refusing to quantize it"
            )
        return w.reshape(n, k // self.group_size, self.group_size)  # (N, K/g, g)

    def _given_scales(self, scales: torch.Tensor, want: tuple[int, ...]) -> torch.Tensor:
        if tuple(scales.shape) != want:
            raise HetquantError(
                f"ct_pack_quantized.quantize: scales has shape {list(scales.shape)}, expected "
                f"{list(want)} ([out, in / {self.group_size}])"
            )
        s = scales.to(torch_dtype(self.scale_dtype))
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise HetquantError(
                f"ct_pack_quantized.quantize: scales must be finite and positive in "
                f"{self.scale_dtype}"
            )
        return s

    def _round_up(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (positive) rounded up to the scale dtype, so that ``result >= x``."""
        y = round_up_to(x, self.scale_dtype)
        if not bool(torch.isfinite(y).all()):
            raise HetquantError(
                f"ct_pack_quantized: weight_scale overflows {self.scale_dtype}; the weight's "
                "values are far too large for this format"
            )
        return y


register(CtPackQuantized())
