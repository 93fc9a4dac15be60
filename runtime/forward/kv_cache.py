"""Emulations of a serving engine's KV-cache storage, for a reference forward that must reproduce
that engine (opt-in: ``hetquant run --kv-cache NAME``; without it keys stay in the activation
dtype). An emulation maps the keys a layer attends to, [S, d] in any float dtype, to what the
engine reads back from its cache, [S, d] bfloat16.

``fp8_ds_mla`` — vLLM 0.32's DeepSeek-V4 cache on the CPU (the only KV layout its CPU attention
keeps: ``models/deepseek_v4/attention.py:106-122``, ``cpu/cpu_sparse.py:401-426``), written by
``fused_qnorm_rope_kv_insert_cpu`` (sliding-window keys) and ``compress_norm_rope_store_cpu``
(compressed entries). One 512-channel row (head_dim 512, rope 64) is stored as 448 FP8 E4M3
"nope" channels with one UE8M0 scale per 64, then the 64 roped channels in bfloat16
(``common/ops/cache_utils.py:41-160``, the same layout's Triton writer). Per block of 64::

    e = max(ceil(log2(max(amax, 1e-4) / 448)), -13)     the scale 2^e (UE8M0)
    y = x / 2^e, clamped to ±448
    q = 0 if |y| < 2^-6 else round-to-nearest-even E4M3(y)      (no subnormals)
    x' = q · 2^e

The floor of -13 and the flush of E4M3 subnormals are the CPU kernel's, where the Triton writer
has neither (``cache_utils.py:121-127``): measured against ``fused_qnorm_rope_kv_insert_cpu`` on
rows spanning amax 1e-9 … 1e5 (every power-of-two boundary) and on values around 2^-6, equal in
every byte (``tests/runtime/vllm/test_vllm_deepseek_v4.py`` repeats the check through vLLM's
op). The rope channels are the bfloat16 rounding of the roped keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetquant.formats import HetquantError

__all__ = ["KV_CACHES", "fp8_ds_mla", "kv_cache"]

FP8_E4M3_MAX = 448.0
_BLOCK = 64  # channels per UE8M0 scale
_ROPE = 64  # the bf16 tail of an fp8_ds_mla row
_MIN_EXP = -13  # the CPU kernel's smallest scale exponent (module docstring)
_MIN_NORMAL = 2.0**-6  # E4M3's smallest normal: below it the CPU kernel stores 0
_AMAX_FLOOR = 1e-4


def fp8_ds_mla(keys: torch.Tensor) -> torch.Tensor:
    """Keys [S, 512] as vLLM's CPU fp8_ds_mla cache gives them back (module docstring)."""
    s, d = keys.shape
    if d != 448 + _ROPE:
        raise HetquantError(f"--kv-cache fp8_ds_mla: keys of {d} channels; the layout stores "
                            f"448 + {_ROPE} (head_dim 512)")  # fmt: skip
    x = keys.to(torch.bfloat16).float()
    nope = x[:, :-_ROPE].view(s, -1, _BLOCK)  # [S, 7, 64]
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=_AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)).clamp(min=_MIN_EXP))
    y = (nope / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = y.to(torch.float8_e4m3fn).float().masked_fill(y.abs() < _MIN_NORMAL, 0.0)
    out = torch.cat([(q * scale).view(s, -1), x[:, -_ROPE:]], dim=-1)
    return out.to(torch.bfloat16)


KV_CACHES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp8_ds_mla": fp8_ds_mla}


def kv_cache(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The emulation called ``name`` (None: keys kept as computed)."""
    if name is None:
        return None
    if name not in KV_CACHES:
        raise HetquantError(f"--kv-cache {name!r}: give one of {', '.join(KV_CACHES)}")
    return KV_CACHES[name]
