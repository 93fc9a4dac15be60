"""Rotary position embedding as DeepSeek-V3 defines it: interleaved pairs, optional YaRN.

Layout. DeepSeek rotates the ``qk_rope_head_dim`` channels of q and k in *adjacent pairs*:
channels ``(2i, 2i+1)`` form one complex number ``x[2i] + j·x[2i+1]`` that is multiplied by
``exp(j·t·ω_i)`` at position ``t`` (DeepSeek-V3 ``inference/model.py`` ``apply_rotary_emb`` views
the last dim as complex pairs). The HF-format checkpoint stores the rope rows of ``q_b_proj`` /
``kv_a_proj_with_mqa`` in exactly that order — ``inference/convert.py`` only renames tensors.
DeepSeek's HF ``modeling_deepseek.py`` reaches the same result by first permuting each head's rope
channels to ``[evens | odds]`` (``view(d/2, 2).transpose``) and then applying the half-split
``rotate_half`` form; that permutation is applied to q and k alike, so q·k is unchanged. Here the
pairs are rotated in place and the layout stays interleaved.

Frequencies. ``ω_i = θ^(-2i/d)`` for ``i < d/2``. With ``rope_scaling = {"type": "yarn", ...}``
(YaRN, as DeepSeek's config defines it) each frequency is blended between itself (extrapolation,
the fast-rotating dims) and ``ω_i / factor`` (interpolation, the slow dims)::

    c(r)  = d · ln(L0 / (2π r)) / (2 ln θ)            # dim index that turns r times over L0
    low   = max(floor(c(beta_fast)), 0);  high = min(ceil(c(beta_slow)), d - 1)
    ramp_i = clamp((i - low) / (high - low), 0, 1)    # (high - low) := 0.001 when equal
    ω'_i  = ω_i · (1 - ramp_i) + (ω_i / factor) · ramp_i

with ``L0 = original_max_position_embeddings``. ``m(s, a) = 0.1·a·ln(s) + 1`` for ``s > 1``, else 1.
cos/sin are multiplied by ``m(factor, mscale) / m(factor, mscale_all_dim)`` (DeepSeek's HF code;
1.0 for every released DeepSeek config, where ``mscale == mscale_all_dim``), and the attention
softmax scale by ``m(factor, mscale_all_dim)²`` (``softmax_mscale``). A missing
``mscale_all_dim`` counts as 0, i.e. no softmax correction, as in DeepSeek's HF code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families.fields import ConfigFields

from .precision import work_dtype

__all__ = ["RopeSpec", "YarnSpec", "apply_rope", "cos_sin", "inv_freq", "yarn_mscale"]


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction ``0.1·mscale·ln(factor) + 1`` (1.0 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnSpec:
    """The ``rope_scaling`` block of a DeepSeek config with ``type: yarn``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of the ``dim`` rope channels of each q / k head."""

    dim: int  # qk_rope_head_dim
    theta: float
    yarn: YarnSpec | None = None

    @classmethod
    def from_config(
        cls, raw: Mapping[str, Any], dim: int, default_theta: float = 10000.0
    ) -> RopeSpec:
        """From a config.json dict (``rope_theta``, ``rope_scaling``) and ``qk_rope_head_dim``;
        every field read is type- and range-checked (``formats.families.fields``)."""
        if dim <= 0 or dim % 2:
            raise HetquantError(f"config.json: qk_rope_head_dim must be even and > 0, got {dim}")
        f = ConfigFields(raw, "config.json")
        scaling = f.mapping("rope_scaling")
        theta = f.number("rope_theta", scaling.number("rope_theta", default_theta, positive=True),
                         positive=True)  # fmt: skip
        kind = scaling.text("type", scaling.text("rope_type", "default"))
        if kind == "default":
            return cls(dim, theta)
        if kind != "yarn":
            raise HetquantError(
                f"config.json: rope_scaling type {kind!r} is not supported; DeepSeek-V3 uses 'yarn'"
            )
        if "factor" not in scaling.raw or "original_max_position_embeddings" not in scaling.raw:
            raise HetquantError(
                "config.json: rope_scaling (yarn) lacks 'factor' or 'original_max_position_embeddings'"
            )
        yarn = YarnSpec(
            factor=scaling.number("factor", positive=True),
            original_max_position_embeddings=scaling.integer("original_max_position_embeddings"),
            beta_fast=scaling.number("beta_fast", 32.0),
            beta_slow=scaling.number("beta_slow", 1.0),
            mscale=scaling.number("mscale", 1.0),
            mscale_all_dim=scaling.number("mscale_all_dim", 0.0),
        )
        return cls(dim, theta, yarn)

    @property
    def softmax_mscale(self) -> float:
        """Factor on the attention softmax scale: ``m(factor, mscale_all_dim)²`` (1 without YaRN)."""
        if self.yarn is None:
            return 1.0
        return yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2

    @property
    def cos_sin_scale(self) -> float:
        """Factor on cos / sin: ``m(factor, mscale) / m(factor, mscale_all_dim)`` (1 without YaRN)."""
        if self.yarn is None:
            return 1.0
        y = self.yarn
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)


def inv_freq(spec: RopeSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Angular frequency of each rope pair, ``dtype`` (float32 or float64) [dim/2] (YaRN-blended
    when configured)."""
    d, theta = spec.dim, spec.theta
    freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=dtype) / d)  # [d/2]
    if spec.yarn is None:
        return freq
    y = spec.yarn

    def turns_dim(rotations: float) -> float:  # dim index that rotates `rotations` times over L0
        return (
            d
            * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(turns_dim(y.beta_fast)), 0)
    high = min(math.ceil(turns_dim(y.beta_slow)), d - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(d // 2, dtype=dtype) - low) / span).clamp(0, 1)  # [d/2]
    return freq * (1 - ramp) + (freq / y.factor) * ramp  # [d/2]


def cos_sin(
    spec: RopeSpec, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions[t] · ω_i``, each ``dtype`` (float32 or float64) [T, dim/2],
    YaRN-scaled."""
    angle = positions.to(dtype)[:, None] * inv_freq(spec, dtype)[None, :]  # [T, d/2]
    scale = spec.cos_sin_scale
    return angle.cos() * scale, angle.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of ``x`` [T, ..., dim] by the angles of ``cos``/``sin`` [T, dim/2].

    Computed in float32 (float64 for float64 ``x``: ``precision.py``) and returned in ``x``'s
    dtype and layout.
    """
    t, d = x.shape[0], x.shape[-1]
    pairs = x.to(work_dtype(x.dtype)).reshape(*x.shape[:-1], d // 2, 2)  # [T, ..., d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]  # [T, ..., d/2] each
    bshape = (t,) + (1,) * (x.ndim - 2) + (d // 2,)
    c, s = cos.reshape(bshape).to(pairs.dtype), sin.reshape(bshape).to(pairs.dtype)  # [T, 1.., d/2]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)  # [T, ..., d/2, 2]
    return rotated.reshape(x.shape).to(x.dtype)  # [T, ..., d]
