"""One decoder layer's AWQ calibration: steps 2-5 of ``calibrate``'s lifecycle.

Mappings of layer ``p = model.layers.L`` (prev op → linears sharing one scale; the prev op
absorbs ``diag(s)⁻¹``, the linears ``diag(s)``):

=================================  ======================================================  =====
prev op                            balanced linears                                        fold
=================================  ======================================================  =====
input_layernorm                    q_a_proj (or q_proj) + kv_a_proj_with_mqa               norm
q_a_layernorm                      q_b_proj                                                norm
kv_a_layernorm                     kv_b_proj                                               norm
kv_b_proj, v rows of every head    o_proj (``fold_o_proj``)                                rows
post_attention_layernorm           dense gate/up, or shared gate/up + EVERY routed         norm
                                   expert's gate/up; router columns × s (compensation)
up_proj (dense, shared, expert e)  down_proj of the same MLP                               rows
=================================  ======================================================  =====

- o_proj: MLA has no v_proj, but ``v = kv_b_proj_v · latent`` per head and the attention output
  ``o[h, d] = Σ_t p[h, t] · v[t, h, d]`` is linear in v, so o_proj's input channel ``h·dv + d``
  divided by s is exactly kv_b_proj's row ``h·(dn + dv) + dn + d`` divided by s. The fold is
  exact, and kv_b_proj's quantization is unchanged by it (RTN per (row, group) is equivariant
  to a row scale, exactly so for powers of two). AutoAWQ has no o_proj mapping.
- Router: ``mlp.gate`` reads the same normed hidden state as the experts. Folding s into
  post_attention_layernorm would change its logits (AutoAWQ's bug, fixed in llm-compressor PR
  #2451), so its columns are multiplied by s: ``(x/s)·(W·s)ᵀ = x·Wᵀ``. The logits are then equal up
  to float rounding: the folded norm and router are stored in BF16 (relative error ≤ 2⁻⁹ per
  element, the order of BF16 activations' own rounding). With ``pow2_scales=True`` both stay
  exact and the logits bit-identical; the default keeps AutoAWQ's continuous scales, which
  measured better on the tiny model with injected outliers (final KL 0.0060 vs 0.0097).
- Experts share one gate/up scale (one norm). The objective sums each expert's error over the
  tokens routed to it (an expert that saw none adds nothing). Per-expert decisions — its
  up→down scale, its clips — need the expert's own inputs; an expert routed fewer than
  ``min_expert_tokens`` tokens (default: the group size, 128 — below that the per-group clip
  objective of ``group_size`` input channels is rank-deficient) uses ALL calibration tokens
  instead (llm-compressor's calibrate-all-experts). ``stats`` records tokens per expert and
  which experts fell back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError

from . import awq
from .forward import Capture, LayerRunner, LayerWeights
from .transforms import AwqOptions, Transform, apply_transform

__all__: list[str] = []  # internal to ``calibrate`` (_Context, _LayerCalibration)


@dataclass
class _Context:
    cfg: Any
    opts: AwqOptions
    device: torch.device
    dtype: torch.dtype
    seq_len: int
    runner: LayerRunner = field(init=False)
    factors: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.runner = LayerRunner(self.cfg, self.seq_len, self.device, self.dtype)
        self.factors = awq.clip_factors(self.opts.clip_grid, self.opts.clip_max_shrink)


class _LayerCalibration:
    """Steps 2-5 of ``calibrate``'s module docstring for one layer."""

    def __init__(
        self, ctx: _Context, layer: int, state: dict[str, torch.Tensor], quantized: set[str]
    ) -> None:
        self.ctx, self.opts, self.layer, self.state = ctx, ctx.opts, layer, state
        self.p = f"model.layers.{layer}"
        self.quantized = {n for n in state if n in quantized}
        self.tf: dict[str, Transform] = {}
        self.searches: dict[str, dict[str, Any]] = {}
        bad = [n for n in self.quantized if state[n].shape[1] % self.opts.group_size]
        if bad:
            raise HetquantError(
                f"{bad[0]}: in features {state[bad[0]].shape[1]} not divisible by group size "
                f"{self.opts.group_size}"
            )

    # orchestration -------------------------------------------------------------------------
    def run(self, h: torch.Tensor) -> tuple[torch.Tensor, dict[str, Transform], dict[str, Any]]:
        cap = Capture()
        out_f = self.ctx.runner.run(self.layer, h, LayerWeights(self.state, cap))
        stats: dict[str, Any] = {"layer": self.layer}
        moe = self.ctx.cfg.is_moe_layer(self.layer)
        if moe:
            self._expert_inputs(cap, stats)
        if self.opts.method == "awq":
            self._attention(cap)
            self._mlps(cap, moe)
        out_q = self.ctx.runner.run(self.layer, h, _QuantizedWeights(self))
        delta = (out_q - out_f).to(torch.float32)
        stats["mse"] = float(delta.pow(2).mean())
        stats["rel_err"] = float(delta.norm() / (out_f - h).to(torch.float32).norm())
        stats["scales"] = self.searches
        return (out_q if self.opts.propagate == "quantized" else out_f), self.tf, stats

    def _expert_inputs(self, cap: Capture, stats: dict[str, Any]) -> None:
        n_exp = self.ctx.cfg.n_routed_experts
        self.moe_x = cap.moe_input  # [M, D]
        self.routed = cap.expert_tokens(n_exp)
        counts = [int(t.numel()) for t in self.routed]
        self.fallback = [e for e, c in enumerate(counts) if c < self.opts.expert_threshold]
        stats["expert_tokens"] = counts
        stats["fallback_experts"] = self.fallback

    def _expert_x(self, e: int) -> torch.Tensor:
        """Expert ``e``'s inputs for per-expert decisions: routed tokens, or all (fallback)."""
        return self.moe_x if e in self.fallback else self.moe_x[self.routed[e]]

    # attention ---------------------------------------------------------------------------------
    def _attention(self, cap: Capture) -> None:
        a, cfg = f"{self.p}.self_attn", self.ctx.cfg
        q_in = [f"{a}.q_a_proj"] if cfg.q_lora_rank else [f"{a}.q_proj"]
        self._balance("attn_in", f"{self.p}.input_layernorm", [*q_in, f"{a}.kv_a_proj_with_mqa"],
                      cap.input(q_in[0]))  # fmt: skip
        if cfg.q_lora_rank:
            self._balance(
                "q_b", f"{a}.q_a_layernorm", [f"{a}.q_b_proj"], cap.input(f"{a}.q_b_proj")
            )
        self._balance(
            "kv_b", f"{a}.kv_a_layernorm", [f"{a}.kv_b_proj"], cap.input(f"{a}.kv_b_proj")
        )
        if self.opts.fold_o_proj:
            self._balance("o", f"{a}.kv_b_proj", [f"{a}.o_proj"], cap.input(f"{a}.o_proj"),
                          rows=self._v_rows())  # fmt: skip
        linears = [*q_in, f"{a}.kv_a_proj_with_mqa", f"{a}.kv_b_proj", f"{a}.o_proj"]
        if cfg.q_lora_rank:
            linears.append(f"{a}.q_b_proj")
        for m in linears:
            self._clip(m, cap.input(m))

    def _v_rows(self) -> torch.Tensor:
        """kv_b_proj's v rows in o_proj input order: head h, channel d → h·(dn+dv) + dn + d."""
        c = self.ctx.cfg
        dn, dv = c.qk_nope_head_dim, c.v_head_dim
        heads = torch.arange(c.num_attention_heads)[:, None] * (dn + dv)
        return (heads + dn + torch.arange(dv)[None, :]).reshape(-1).to(self.ctx.device)

    # MLPs ------------------------------------------------------------------------------------
    def _mlps(self, cap: Capture, moe: bool) -> None:
        p = f"{self.p}.mlp"
        norm = f"{self.p}.post_attention_layernorm"
        if not moe:
            x = cap.input(f"{p}.gate_proj")
            self._balance("mlp_in", norm, [f"{p}.gate_proj", f"{p}.up_proj"], x)
            self._mlp_unit(p, x, cap.input(f"{p}.down_proj"))
            return
        n_exp, shared = self.ctx.cfg.n_routed_experts, f"{p}.shared_experts"
        mods: list[str] = []
        rows: list[torch.Tensor | None] = []  # None: all tokens (shared experts)
        if self.ctx.cfg.n_shared_experts:
            mods += [f"{shared}.gate_proj", f"{shared}.up_proj"]
            rows += [None, None]
        for e in range(n_exp):  # the objective: each expert on its routed tokens only
            mods += [f"{p}.experts.{e}.gate_proj", f"{p}.experts.{e}.up_proj"]
            rows += [self.routed[e], self.routed[e]]
        self._balance("mlp_in", norm, mods, _RowsOf(self.moe_x, rows),
                      x_mean=awq.activation_mean(self.moe_x), compensate=f"{p}.gate")  # fmt: skip
        if self.ctx.cfg.n_shared_experts:
            self._mlp_unit(shared, self.moe_x, cap.input(f"{shared}.down_proj"))
        for e in range(n_exp):
            self._mlp_unit(f"{p}.experts.{e}", self._expert_x(e), None)

    def _mlp_unit(self, prefix: str, x: torch.Tensor, x_down: torch.Tensor | None) -> None:
        """up → down balance of one MLP, then the clips of its three linears."""
        if x_down is None:  # a routed expert: its down input from the float weights
            w = LayerWeights(self.state)
            x_down = F.silu(w.linear(f"{prefix}.gate_proj", x)) * w.linear(f"{prefix}.up_proj", x)
        self._balance(
            f"down:{prefix.removeprefix(self.p + '.')}",
            f"{prefix}.up_proj",
            [f"{prefix}.down_proj"],
            x_down,
        )
        for m in ("gate_proj", "up_proj"):
            self._clip(f"{prefix}.{m}", x)
        self._clip(f"{prefix}.down_proj", x_down)

    # the two searches --------------------------------------------------------------------------
    def _balance(
        self,
        label: str,
        prev: str,
        modules: list[str],
        x: torch.Tensor | list[torch.Tensor],
        *,
        x_mean: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        compensate: str | None = None,
    ) -> None:
        """Search the scale of ``modules`` and fold it (``prev``: a norm, or a linear's rows)."""
        o = self.opts
        ws = [self.state[f"{m}.weight"] for m in modules]
        found = awq.search_scale(
            ws, x, o.group_size, o.grid, x_mean=x_mean, duo_scaling=o.duo_scaling,
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
        if not o.clip or module.rsplit(".", 1)[-1] in o.clip_skip:
            return
        t = self.tf.get(name)
        w = apply_transform(self.state[name], t, o.group_size, self.ctx.factors)
        if t is not None and t.col_mul is not None:
            x = x / t.col_mul.to(x.dtype)
        shrink = awq.search_clip(
            w, x, o.group_size, grid=o.clip_grid, max_shrink=o.clip_max_shrink,
            n_tokens=o.clip_tokens,
        )  # fmt: skip
        if bool(shrink.any()):
            self._tf(name).shrink = shrink

    def _tf(self, name: str) -> Transform:
        return self.tf.setdefault(name, Transform())


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
        super().__init__(lc.state)
        self.lc = lc

    def get(self, name: str) -> torch.Tensor:
        w = super().get(name)
        lc = self.lc
        t = lc.tf.get(name)
        if name in lc.quantized:
            w2 = apply_transform(w, t, lc.opts.group_size, lc.ctx.factors)
            return awq.fake_quantize(w2, lc.opts.group_size)
        if t is None:
            return w
        return apply_transform(w, t, lc.opts.group_size, lc.ctx.factors).to(w.dtype)
