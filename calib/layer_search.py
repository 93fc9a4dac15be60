"""The searches of one layer's AWQ calibration (``calib/layer.py`` walks the family's mappings
and calls them): a balance's scale (``awq.search_scale``, or ``smooth.act_aware_search`` where
an activation-quantized linear takes it) and its fold, a linear's clip, GPTQ codes; and the layer
as the artifact holds it (``QuantizedWeights``), which scores them and gives step 5's forward.

Each function reads and records on the layer's ``_LayerCalibration`` (``lc``): its state, its
quantizers and searched names, its transforms (``lc.tf``) and its search stats (``lc.searches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hetquant.runtime.forward.moe import swiglu
from hetquant.runtime.forward.precision import work_dtype

from . import awq, gptq, smooth
from .forward import LayerWeights
from .transforms import Transform, apply_transform

if TYPE_CHECKING:
    from .layer import _LayerCalibration

__all__ = ["QuantizedWeights", "balance", "clip", "gptq_codes", "quantized_act"]


def balance(
    lc: _LayerCalibration,
    label: str,
    prev: str,
    modules: list[str],
    x: torch.Tensor | Sequence[torch.Tensor],
    *,
    x_mean: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    compensate: str | None = None,
) -> None:
    """Search the scale of ``modules`` and fold it (``prev``: a norm, or a linear's rows):
    every one takes it, the quantized ones' errors score it."""
    o = lc.opts
    ws = [lc.state[f"{m}.weight"] for m in modules]
    qs = [lc.q.get(f"{m}.weight") for m in modules]  # None: kept in float
    if o.act_aware and any(q is not None and q.fmt.name in smooth.ACT_QUANT for q in qs):
        found = smooth.act_aware_search(ws, x, qs, o.grid, x_mean=x_mean, duo_scaling=o.duo_scaling)
    else:
        found = awq.search_scale(
            ws, x, qs, o.grid, x_mean=x_mean, duo_scaling=o.duo_scaling,
            pow2=o.pow2_scales, matmul_dtype=lc.ctx.dtype,
        )  # fmt: skip
    s = found.scales
    lc.searches[label] = {
        "ratio": found.ratio,
        "loss": found.loss,
        "identity_loss": found.identity_loss,
    }
    for m in modules:
        lc.transform(f"{m}.weight").col_mul = s
    if compensate is not None:
        lc.transform(f"{compensate}.weight").col_mul = s
    target = lc.transform(f"{prev}.weight")
    if rows is None:
        target.row_div = s
    else:
        div = torch.ones(lc.state[f"{prev}.weight"].shape[0], device=s.device)
        div[rows] = s
        target.row_div = div


def clip(lc: _LayerCalibration, module: str, x: torch.Tensor) -> None:
    o, name = lc.opts, f"{module}.weight"
    if not o.clip or module.rsplit(".", 1)[-1] in o.clip_skip or name not in lc.searched:
        return
    t = lc.tf.get(name)
    w = apply_transform(lc.state[name], t, lc.ctx.factors)
    if t is not None and t.col_mul is not None:
        x = x / t.col_mul.to(x.dtype)
    shrink = awq.search_clip(
        w, x, lc.q[name], grid=o.clip_grid, max_shrink=o.clip_max_shrink,
        n_tokens=o.clip_tokens,
    )  # fmt: skip
    if bool(shrink.any()):
        lc.transform(name).shrink = shrink


def quantized_act(lc: _LayerCalibration, gate: str, up: str, x: torch.Tensor) -> torch.Tensor:
    """``silu(x·Q(G')ᵀ) ⊙ (x·Q(U')ᵀ)`` with the transformed, quantized gate and up (``x``
    divided by their column scale): down's input in its own scaled space (up's rows
    absorbed down's ``diag(s)⁻¹``), in ``work_dtype`` of ``x``."""
    w = QuantizedWeights(lc)
    g, u = (w.get(f"{m}.weight") for m in (gate, up))
    col_mul = lc.tf[f"{gate}.weight"].col_mul if f"{gate}.weight" in lc.tf else None
    acc = work_dtype(x.dtype)
    xs = x.to(acc) if col_mul is None else x.to(acc) / col_mul.to(acc)
    return swiglu(xs @ g.to(acc).T, xs @ u.to(acc).T, lc.ctx.runner.limit)


def gptq_codes(
    lc: _LayerCalibration, modules: Sequence[str], x: torch.Tensor, *, scaled: bool = False
) -> None:
    """GPTQ codes of the searched ``modules`` that read one input ``x`` with the same column
    scale (an MLP's gate and up: one Hessian, rows stacked), on their AWQ-scaled weights and
    the grids of their clipped weights (``gptq.py``). ``scaled``: ``x`` is already divided
    by that scale."""
    o, f = lc.opts, lc.ctx.factors
    names = [f"{m}.weight" for m in modules]
    names = [n for n in names if n in lc.searched and lc.q[n].fmt.name in gptq.GRIDS]
    if not names:
        return
    tfs = [lc.transform(n) for n in names]
    col_mul = tfs[0].col_mul
    if any(not _same(t.col_mul, col_mul) for t in tfs[1:]):
        for n in names:  # different inputs after the fold: one at a time
            gptq_codes(lc, [n.removesuffix(".weight")], x, scaled=scaled)
        return
    ws = [lc.state[n] for n in names]
    w_scaled = [apply_transform(w, Transform(t.col_mul, t.row_div), f) for w, t in zip(ws, tfs, strict=True)]  # fmt: skip
    clipped = [apply_transform(w, t, f) for w, t in zip(ws, tfs, strict=True)]
    if col_mul is not None and not scaled:
        x = x / col_mul.to(x.dtype)
    found = gptq.gptq(
        names[0], torch.cat(w_scaled), torch.cat(clipped), gptq.hessian(x, ws[0].shape[1]),
        lc.q[names[0]], damp=o.gptq_damp, act_order=o.gptq_act_order,
    )  # fmt: skip
    row0 = 0
    for t, w in zip(tfs, ws, strict=True):
        rows = slice(row0, row0 + w.shape[0])
        t.codes, t.qscale = found.codes[rows].clone(), found.scale[rows].clone()
        row0 += w.shape[0]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


class QuantizedWeights(LayerWeights):
    """The layer as the artifact holds it: quantized linears fake-quantized (on use, one at a
    time), folded norms and the compensated router cast back to their source dtype."""

    def __init__(self, lc: _LayerCalibration) -> None:
        super().__init__(lc.state, family=lc.fam)
        self.lc = lc

    def get(self, name: str) -> torch.Tensor:
        w = super().get(name)
        lc = self.lc
        t = lc.tf.get(name)
        if name in lc.q:
            return lc.q[name](apply_transform(w, t, lc.ctx.factors))
        if t is None:
            return w
        return apply_transform(w, t, lc.ctx.factors).to(w.dtype)
