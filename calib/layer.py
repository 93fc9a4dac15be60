"""One decoder layer's AWQ calibration: steps 2-5 of ``calibrate``'s lifecycle.

What is balanced with what is the model family's data (``formats/families/mappings.py`` says
how a mapping runs; ``deepseek_v3.py`` lists DeepSeek-V3's): ``_attention`` runs the family's
``balances`` and the clips of its ``clips`` linears, ``_mlps`` the ``mlp_input`` balance and then,
for every gated MLP of the role table, its up → down balance and the clips of its three linears.
A prev op absorbs ``diag(s)⁻¹`` (a norm its elements, a linear its rows), the linears ``diag(s)``.

What is searched: every quantized linear has its target's quantizer (``targets``: ``Q`` in the
objectives and in the quantized forward of step 5); the *searched* ones get the searches — a
balance runs when one of its linears is searched, and every linear that reads its input takes
the scale, so the float model stays the same (the others are scored with their own ``Q``, a
float one adding no error), a clip only for a searched linear. ``awq-w4a16`` searches every
linear; ``ct-w4a16`` its routed experts (the experts' balance also scales the shared expert's
gate and up, which stay at source precision); ``ascend-hybrid`` its routed experts, the shared
expert's W8A8 error in the objective (``convert/recipes/quantized.py``).

- Router compensation: the router reads the same normed hidden state as the experts. Folding s
  into the norm would change its logits (AutoAWQ's bug, fixed in llm-compressor PR #2451), so its
  columns are multiplied by s: ``(x/s)·(W·s)ᵀ = x·Wᵀ``. The logits are then equal up to float
  rounding: the folded norm and router are stored in BF16 (relative error ≤ 2⁻⁹ per element, the
  order of BF16 activations' own rounding). With ``pow2_scales=True`` both stay exact and the
  logits bit-identical; the default keeps AutoAWQ's continuous scales, which measured better on
  the tiny model with injected outliers (final KL 0.0060 vs 0.0097).
- A rows fold (DeepSeek's o_proj into kv_b_proj's v rows) is exact, and the folded linear's
  quantization is unchanged by it (RTN per (row, group) is equivariant to a row scale, exactly so
  for powers of two). AutoAWQ has no o_proj mapping.
- Experts share one gate/up scale (one norm). The objective sums each expert's error over the
  tokens routed to it (an expert that saw none adds nothing). Per-expert decisions — its
  up→down scale, its clips — need the expert's own inputs; an expert routed fewer than
  ``min_expert_tokens`` tokens (default: the group size, 128 — below that the per-group clip
  objective of ``group_size`` input channels is rank-deficient) uses ALL calibration tokens
  instead (llm-compressor's calibrate-all-experts). ``stats`` records tokens per expert and
  which experts fell back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch

from hetquant.formats.families import Balance
from hetquant.runtime.forward.moe import swiglu
from hetquant.runtime.forward.precision import work_dtype

from . import awq, gptq, smooth
from .forward import Capture, LayerRunner, LayerWeights
from .quantizer import Quantizer
from .transforms import AwqOptions, Transform, apply_transform

__all__: list[str] = []  # internal to ``calibrate`` (_Context, _LayerCalibration)


@dataclass
class _Context:
    cfg: Any
    opts: AwqOptions
    device: torch.device
    dtype: torch.dtype
    seq_len: int
    tokens: torch.Tensor | None = None  # [N, T]: for a family whose layers read them (V4)
    runner: LayerRunner = field(init=False)
    factors: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.runner = LayerRunner(self.cfg, self.seq_len, self.device, self.dtype)
        self.factors = awq.clip_factors(self.opts.clip_grid, self.opts.clip_max_shrink)


class _LayerCalibration:
    """Steps 2-5 of ``calibrate``'s module docstring for one layer."""

    def __init__(
        self,
        ctx: _Context,
        layer: int,
        state: dict[str, torch.Tensor],
        targets: Mapping[str, Quantizer],
        searched: Set[str],
    ) -> None:
        self.ctx, self.opts, self.layer, self.state = ctx, ctx.opts, layer, state
        self.fam = ctx.cfg.family
        self.p = self.fam.layer_prefix.format(layer=layer)
        self.has = {r.name for r in self.fam.layer_roles(ctx.cfg, layer)}  # roles of this layer
        self.q = {n: targets[n] for n in state if n in targets}  # this layer's quantized linears
        self.searched = {n for n in self.q if n in searched}
        self.tf: dict[str, Transform] = {}
        self.searches: dict[str, dict[str, Any]] = {}
        for n, q in self.q.items():
            q.check(n, tuple(state[n].shape))

    # orchestration -------------------------------------------------------------------------
    def run(self, h: torch.Tensor) -> tuple[torch.Tensor, dict[str, Transform], dict[str, Any]]:
        cap = Capture()
        weights = LayerWeights(self.state, cap, family=self.fam)
        out_f = self.ctx.runner.run(self.layer, h, weights, self.ctx.tokens)
        stats: dict[str, Any] = {"layer": self.layer}
        moe = self.ctx.cfg.is_moe_layer(self.layer)
        if moe:
            self._expert_inputs(cap, stats)
        if self.opts.method == "awq":
            self._attention(cap)
            self._mlps(cap)
        out_q = self.ctx.runner.run(self.layer, h, _QuantizedWeights(self), self.ctx.tokens)
        delta = (out_q - out_f).to(torch.float32)
        stats["mse"] = float(delta.pow(2).mean())
        stats["rel_err"] = float(delta.norm() / (out_f - h).to(torch.float32).norm())
        stats["scales"] = self.searches
        return (out_q if self.opts.propagate == "quantized" else out_f), self.tf, stats

    def _expert_inputs(self, cap: Capture, stats: dict[str, Any]) -> None:
        self.moe_x = cap.moe_input  # [M, D]
        self.routed = cap.expert_tokens(self.ctx.cfg.num_experts)
        counts = [int(t.numel()) for t in self.routed]
        self.fallback = [e for e, c in enumerate(counts) if c < self.opts.expert_threshold]
        stats["expert_tokens"] = counts
        stats["fallback_experts"] = self.fallback

    def _expert_x(self, e: int) -> torch.Tensor:
        """Expert ``e``'s inputs for per-expert decisions: routed tokens, or all (fallback)."""
        return self.moe_x if e in self.fallback else self.moe_x[self.routed[e]]

    def _m(self, role: str, e: int | None = None) -> str:
        """The module of ``role`` in this layer (routed expert ``e``)."""
        return self.fam.module(role, self.layer, e)

    # the family's mappings -----------------------------------------------------------------
    def _attention(self, cap: Capture) -> None:
        """The family's ``balances`` (those whose option is on), then its ``clips``."""
        mappings = self.fam.awq
        for b in mappings.balances:
            on = b.option is None or getattr(self.opts, b.option)
            if on and (b.when is None or b.when(self.ctx.cfg)):
                self._mapping(b, cap)
        for role in mappings.clips:
            if role in self.has and f"{self._m(role)}.weight" in self.searched:
                self._clip(self._m(role), cap.input(self._m(role)))

    def _mlps(self, cap: Capture) -> None:
        """The MLP input balance, then each gated MLP's up → down balance and clips."""
        if self.fam.awq.mlp_input is not None:
            self._mapping(self.fam.awq.mlp_input, cap)
        for mlp in self.fam.mlps:
            if mlp.gate not in self.has:
                continue
            roles = (mlp.gate, mlp.up, mlp.down)
            if mlp.expert != "routed":
                mods = [self._m(r) for r in roles]
                if self._searches(mods):
                    self._mlp_unit(_parent(mods[0]), mods, cap.input(mods[0]), cap.input(mods[2]))
                continue
            for e in range(self.ctx.cfg.num_experts):
                mods = [self._m(r, e) for r in roles]
                if self._searches(mods):
                    self._mlp_unit(_parent(mods[0]), mods, self._expert_x(e), None)

    def _searches(self, modules: Sequence[str]) -> bool:
        """Whether any of ``modules`` is searched (module docstring)."""
        return any(f"{m}.weight" in self.searched for m in modules)

    def _mapping(self, b: Balance, cap: Capture) -> None:
        """One balance of the family (``formats/families/mappings.py`` says how it runs)."""
        present = [r for r in b.linears if r in self.has]
        if not present or b.prev not in self.has:
            return
        routed = [r for r in present if self.fam.role(r).expert == "routed"]
        mods = [self._m(r) for r in present if r not in routed]
        rows: list[torch.Tensor | None] = [None] * len(mods)  # None: all tokens
        for e in range(self.ctx.cfg.num_experts) if routed else ():
            mods += [self._m(r, e) for r in routed]  # the objective: each expert on its tokens
            rows += [self.routed[e]] * len(routed)
        if not self._searches(mods):
            return
        if routed:
            x: torch.Tensor | Sequence[torch.Tensor] = _RowsOf(self.moe_x, rows)
            x_mean = awq.activation_mean(self.moe_x)
        else:
            x, x_mean = cap.input(mods[0]), None
        fold_rows = None if b.rows is None else b.rows(self.ctx.cfg).to(self.ctx.device)
        compensate = self._m(b.compensate) if b.compensate in self.has else None
        self._balance(b.label, self._m(b.prev), mods, x, x_mean=x_mean, rows=fold_rows,
                      compensate=compensate)  # fmt: skip

    def _mlp_unit(
        self, prefix: str, mods: Sequence[str], x: torch.Tensor, x_down: torch.Tensor | None
    ) -> None:
        """up → down balance of one MLP (``mods``: gate, up, down), then its three clips."""
        gate, up, down = mods
        if x_down is None:  # a routed expert: its down input from the float weights
            w = LayerWeights(self.state, family=self.fam)
            x_down = swiglu(w.linear(gate, x), w.linear(up, x), self.ctx.runner.limit)
        if self._searches([down]):
            self._balance(f"down:{prefix.removeprefix(self.p)}", up, [down], x_down)
        for m in (gate, up):
            self._clip(m, x)
        self._clip(down, x_down)
        if self.opts.gptq:
            self._gptq([gate, up], x)  # one input, one Hessian: rows are independent
            if self.opts.gptq_sequential:  # down's Hessian on what the quantized gate/up give
                self._gptq([down], self._quantized_act(gate, up, x), scaled=True)
            else:
                self._gptq([down], x_down)

    # the two searches --------------------------------------------------------------------------
    def _balance(
        self,
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
        o = self.opts
        ws = [self.state[f"{m}.weight"] for m in modules]
        qs = [self.q.get(f"{m}.weight") for m in modules]  # None: kept in float
        if o.act_aware and any(q is not None and q.fmt.name in smooth.ACT_QUANT for q in qs):
            found = smooth.act_aware_search(
                ws, x, qs, o.grid, x_mean=x_mean, duo_scaling=o.duo_scaling
            )
        else:
            found = awq.search_scale(
                ws, x, qs, o.grid, x_mean=x_mean, duo_scaling=o.duo_scaling,
                pow2=o.pow2_scales, matmul_dtype=self.ctx.dtype,
            )  # fmt: skip
        s = found.scales
        self.searches[label] = {
            "ratio": found.ratio,
            "loss": found.loss,
            "identity_loss": found.identity_loss,
        }
        for m in modules:
            self._tf(f"{m}.weight").col_mul = s
        if compensate is not None:
            self._tf(f"{compensate}.weight").col_mul = s
        target = self._tf(f"{prev}.weight")
        if rows is None:
            target.row_div = s
        else:
            div = torch.ones(self.state[f"{prev}.weight"].shape[0], device=s.device)
            div[rows] = s
            target.row_div = div

    def _clip(self, module: str, x: torch.Tensor) -> None:
        o, name = self.opts, f"{module}.weight"
        if not o.clip or module.rsplit(".", 1)[-1] in o.clip_skip or name not in self.searched:
            return
        t = self.tf.get(name)
        w = apply_transform(self.state[name], t, self.ctx.factors)
        if t is not None and t.col_mul is not None:
            x = x / t.col_mul.to(x.dtype)
        shrink = awq.search_clip(
            w, x, self.q[name], grid=o.clip_grid, max_shrink=o.clip_max_shrink,
            n_tokens=o.clip_tokens,
        )  # fmt: skip
        if bool(shrink.any()):
            self._tf(name).shrink = shrink

    def _quantized_act(self, gate: str, up: str, x: torch.Tensor) -> torch.Tensor:
        """``silu(x·Q(G')ᵀ) ⊙ (x·Q(U')ᵀ)`` with the transformed, quantized gate and up (``x``
        divided by their column scale): down's input in its own scaled space (up's rows
        absorbed down's ``diag(s)⁻¹``), in ``work_dtype`` of ``x``."""
        w = _QuantizedWeights(self)
        g, u = (w.get(f"{m}.weight") for m in (gate, up))
        col_mul = self.tf[f"{gate}.weight"].col_mul if f"{gate}.weight" in self.tf else None
        acc = work_dtype(x.dtype)
        xs = x.to(acc) if col_mul is None else x.to(acc) / col_mul.to(acc)
        return swiglu(xs @ g.to(acc).T, xs @ u.to(acc).T, self.ctx.runner.limit)

    def _gptq(self, modules: Sequence[str], x: torch.Tensor, *, scaled: bool = False) -> None:
        """GPTQ codes of the searched ``modules`` that read one input ``x`` with the same column
        scale (an MLP's gate and up: one Hessian, rows stacked), on their AWQ-scaled weights and
        the grids of their clipped weights (``gptq.py``). ``scaled``: ``x`` is already divided
        by that scale."""
        o, f = self.opts, self.ctx.factors
        names = [f"{m}.weight" for m in modules]
        names = [n for n in names if n in self.searched and self.q[n].fmt.name in gptq.GRIDS]
        if not names:
            return
        tfs = [self._tf(n) for n in names]
        col_mul = tfs[0].col_mul
        if any(not _same(t.col_mul, col_mul) for t in tfs[1:]):
            for n in names:  # different inputs after the fold: one at a time
                self._gptq([n.removesuffix(".weight")], x, scaled=scaled)
            return
        ws = [self.state[n] for n in names]
        w_scaled = [apply_transform(w, Transform(t.col_mul, t.row_div), f) for w, t in zip(ws, tfs, strict=True)]  # fmt: skip
        clipped = [apply_transform(w, t, f) for w, t in zip(ws, tfs, strict=True)]
        if col_mul is not None and not scaled:
            x = x / col_mul.to(x.dtype)
        found = gptq.gptq(
            names[0], torch.cat(w_scaled), torch.cat(clipped), gptq.hessian(x, ws[0].shape[1]),
            self.q[names[0]], damp=o.gptq_damp, act_order=o.gptq_act_order,
        )  # fmt: skip
        row0 = 0
        for t, w in zip(tfs, ws, strict=True):
            rows = slice(row0, row0 + w.shape[0])
            t.codes, t.qscale = found.codes[rows].clone(), found.scale[rows].clone()
            row0 += w.shape[0]

    def _tf(self, name: str) -> Transform:
        return self.tf.setdefault(name, Transform())


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _parent(module: str) -> str:
    return module.rpartition(".")[0]


class _RowsOf(Sequence[torch.Tensor]):
    """``x[rows[i]]`` (all of ``x`` where ``rows[i]`` is None), made on demand; neighbours with
    the same index tensor (an expert's gate and up) get the same tensor object."""

    def __init__(self, x: torch.Tensor, rows: list[torch.Tensor | None]) -> None:
        self.x, self.rows = x, rows
        self._last: tuple[torch.Tensor | None, torch.Tensor] = (None, x)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        r = self.rows[i]
        if r is None:
            return self.x
        if self._last[0] is not r:
            self._last = (r, self.x[r])
        return self._last[1]


class _QuantizedWeights(LayerWeights):
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
