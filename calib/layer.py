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

Where the code lives: this module walks the family's mappings (``_attention``, ``_mlps``);
the searches they run — a balance's scale and fold, a clip, GPTQ codes — and the layer as the
artifact holds it (``QuantizedWeights``) are in ``calib/layer_search.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch

from hetquant.formats.families import Balance
from hetquant.runtime.forward.moe import swiglu

from . import awq
from . import layer_search as search
from .forward import Capture, LayerRunner, LayerWeights
from .quantizer import Quantizer
from .transforms import AwqOptions, Transform

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
        out_q = self.ctx.runner.run(self.layer, h, search.QuantizedWeights(self), self.ctx.tokens)
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
                search.clip(self, self._m(role), cap.input(self._m(role)))

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
        search.balance(self, b.label, self._m(b.prev), mods, x, x_mean=x_mean, rows=fold_rows,
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
            search.balance(self, f"down:{prefix.removeprefix(self.p)}", up, [down], x_down)
        for m in (gate, up):
            search.clip(self, m, x)
        search.clip(self, down, x_down)
        if self.opts.gptq:
            search.gptq_codes(self, [gate, up], x)  # one input, one Hessian: rows are independent
            if self.opts.gptq_sequential:  # down's Hessian on what the quantized gate/up give
                search.gptq_codes(
                    self, [down], search.quantized_act(self, gate, up, x), scaled=True
                )
            else:
                search.gptq_codes(self, [down], x_down)

    def transform(self, name: str) -> Transform:
        return self.tf.setdefault(name, Transform())


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
