"""Lossless repacks of a source format's routed experts into an expert-layer format.

``EXPERT_REPACKS[(source format, expert-layer format)]`` takes one expert's stored source tensors
(gate, up, down: each a dict of the source format's stored tensors) and returns its slice of every
stacked layer tensor, without dequantizing: codes and scales are carried over as they are. A recipe
that sends routed experts to a CPU INT4 format picks the repack when the source has one
(``convert/recipes/quantized.py``), so that quantization-aware-trained codes (Kimi K2 Thinking's
compressed-tensors INT4, group 32) are kept, never rounded a second time.

| source | expert-layer format | how |
|---|---|---|
| ``ct_pack_quantized`` (symmetric, group g, BF16 scales) | ``int4_cpu_group_experts`` (group g) | ``int4_cpu_group.expert_from_ct``: the I32 words viewed as bytes, scales as stored |
| ``fp4_e2m1`` (DeepSeek-V4's FP4 experts) | ``fp4_cpu_experts`` | ``fp4_cpu.expert_from_fp4``: the I8 codes viewed as bytes, UE8M0 scales as stored |
"""

from __future__ import annotations

from collections.abc import Callable

from ._lazy import torch
from .fp4_cpu import expert_from_fp4
from .int4_cpu_group import expert_from_ct

__all__ = ["EXPERT_REPACKS", "Repack", "repack_target"]

Repack = Callable[..., "dict[str, torch.Tensor]"]  # (gate, up, down stored dicts) → layer slices

EXPERT_REPACKS: dict[tuple[str, str], Repack] = {
    ("ct_pack_quantized", "int4_cpu_group_experts"): expert_from_ct,
    ("fp4_e2m1", "fp4_cpu_experts"): expert_from_fp4,
}


def repack_target(source_fmt: str) -> str | None:
    """The expert-layer format a source format's experts repack into losslessly (None: none)."""
    return next((dst for (src, dst) in EXPERT_REPACKS if src == source_fmt), None)
