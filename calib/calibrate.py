"""Streaming AWQ calibration of a DeepSeek-V3 checkpoint, one decoder layer at a time.

Lifecycle (``calibrate``): embed the calibration tokens [N, T]; then for each decoder layer L:

1. dequantize layer L's tensors only (FP8 → BF16 with DeepSeek's formula) onto the compute
   device (``cuda`` / ``npu`` when present, else cpu);
2. run the float layer on the incoming hidden states with a ``Capture``: the input of every
   linear, and the router's choice, so every routed expert is seen with its own routed tokens
   (``forward.py``);
3. search the AWQ scales (``awq.search_scale``) of the mappings below, all on the float weights
   and float inputs of step 2 (as AutoAWQ: search every group, then apply);
4. fold them (``Transform``), then search the clip of every quantized linear on its transformed
   weight and transformed input (``awq.search_clip``; AutoAWQ skips q_a / q_b / q);
5. run the layer again with the transformed, fake-quantized weights (AwqW4A16 RTN of the final
   weight, the artifact's exact values) and pass ITS output to layer L + 1 (``propagate=
   "quantized"``, llm-compressor's default: later layers calibrate on the inputs they will see;
   AutoAWQ passes the float output, ``propagate="float"``); free layer L.

Peak memory is one layer's BF16 tensors + the hidden states and captured inputs + one float32
weight at a time; per-layer peaks (RSS via ``/proc/self/status`` VmHWM, reset per layer, and the
device allocator's peak) are in ``stats``. The multi-token-prediction layers are not calibrated
(the runtime has no MTP forward): a converter quantizes them round-to-nearest.

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

``method="rtn"`` runs the same pipeline with identity scales and no clip: the round-to-nearest
baseline the recipe produces without calibration data.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError

from . import awq
from .data import tokens_digest
from .forward import (
    Capture,
    LayerRunner,
    LayerWeights,
    check_tokens,
    default_device,
    layer_names,
    source_tensor_fn,
)

__all__ = [
    "AwqOptions",
    "CalibrationResult",
    "Transform",
    "calibrate",
    "is_quantized_linear",
]

RESULT_JSON = "calibration.json"
RESULT_FORMAT = "hetquant-awq-calibration"
RESULT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LINEARS = frozenset(
    "q_proj q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj gate_proj up_proj down_proj".split()
)


@dataclass(frozen=True)
class AwqOptions:
    """Calibration options (defaults: AutoAWQ's, plus the decisions in the module docstring)."""

    method: str = "awq"  # "awq" | "rtn" (identity scales, no clip: the baseline)
    group_size: int = 128
    grid: int = 20  # scale-search grid: α = k / grid, k < grid
    duo_scaling: bool = True
    pow2_scales: bool = False  # True: scales rounded to powers of two, every fold bit-exact
    clip: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    clip_tokens: int = 512
    clip_skip: tuple[str, ...] = ("q_a_proj", "q_b_proj", "q_proj")
    # Off by default: the fold is exact, but it rescales kv_b_proj's v rows, which are quantized
    # too; on the trained tiny model it cost more than the o_proj search gained (ΔPPL +1.47% vs
    # +0.92% without, KL 0.0324 vs 0.0320; benchmarks/awq_sweep.py).
    fold_o_proj: bool = False
    min_expert_tokens: int | None = None  # None: group_size
    propagate: str = "quantized"  # "quantized" | "float"
    dtype: str | None = None  # compute dtype; None: float32 on cpu, bfloat16 on accelerators

    def __post_init__(self) -> None:
        if self.method not in ("awq", "rtn"):
            raise HetquantError(f"calibration method {self.method!r}; use 'awq' or 'rtn'")
        if self.propagate not in ("quantized", "float"):
            raise HetquantError(f"propagate {self.propagate!r}; use 'quantized' or 'float'")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise HetquantError(f"dtype {self.dtype!r}; use one of {sorted(_DTYPES)}")

    @property
    def expert_threshold(self) -> int:
        return self.group_size if self.min_expert_tokens is None else self.min_expert_tokens

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.float32 if device.type == "cpu" else torch.bfloat16

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clip_skip"] = list(self.clip_skip)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AwqOptions:
        return cls(**{**d, "clip_skip": tuple(d.get("clip_skip", ()))})


@dataclass
class Transform:
    """What calibration does to one source tensor W (2-D [N, K], or a 1-D norm weight [K]):

    ``W' = clamp(fold_rows(W · diag(col_mul), row_div), ±bounds(shrink))`` — columns times
    ``col_mul`` [K], rows (norm: elements) divided by ``row_div`` [N], then, for a quantized
    linear, each (row, group) clamped to ``max|W'_group| · (1 - shrink / clip_grid)``. Every
    part is optional. The quantized artifact stores ``AwqW4A16.quantize(W')``.
    """

    col_mul: torch.Tensor | None = None
    row_div: torch.Tensor | None = None
    shrink: torch.Tensor | None = None  # uint8 [N, K/g]

    def to(self, device: str | torch.device) -> Transform:
        move = lambda v: None if v is None else v.to(device)  # noqa: E731
        return Transform(move(self.col_mul), move(self.row_div), move(self.shrink))

    def tensors(self) -> dict[str, torch.Tensor]:
        items = {"col_mul": self.col_mul, "row_div": self.row_div, "shrink": self.shrink}
        return {k: v.cpu().clone() for k, v in items.items() if v is not None}  # unshared


def apply_transform(
    w: torch.Tensor, t: Transform | None, group_size: int, factors: torch.Tensor, row0: int = 0
) -> torch.Tensor:
    """``t`` applied to ``w`` (or to rows ``row0 : row0 + len(w)`` of the full tensor): float32."""
    out = w.to(torch.float32)
    if t is None:
        return out
    rows = slice(row0, row0 + out.shape[0])
    if t.col_mul is not None:
        out = awq.scale_columns(out, t.col_mul.to(out.device))
    if t.row_div is not None:
        div = t.row_div[rows].to(out.device)
        out = awq.fold_into_norm(out, div) if out.ndim == 1 else awq.fold_into_linear(out, div)
    if t.shrink is not None:
        shrink = t.shrink[rows].to(out.device)
        out = awq.apply_clip(out, awq.clip_bounds(out, shrink, group_size, factors), group_size)
    return out


def is_quantized_linear(name: str, num_hidden_layers: int) -> bool:
    """Whether source tensor ``name`` is a decoder-layer linear that AWQ quantizes: the MLA
    projections and every MLP / expert projection of layers ``0 .. num_hidden_layers - 1`` (not
    the router ``mlp.gate``, not the MTP layers) — the awq-w4a16 recipe's quantized set."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return int(parts[2]) < num_hidden_layers and parts[-1] == "weight" and parts[-2] in _LINEARS


@dataclass
class CalibrationResult:
    """Per source tensor, what calibration changed (see ``Transform``), plus statistics.

    - ``quantized``: the linear weight names that were calibrated; store each as
      ``AwqW4A16(group_size).quantize(result.apply(name, w))``.
    - ``changed``: every tensor whose values change: those linears, the folded norms and the
      compensated routers. Non-linear ones are written in their source dtype
      (``result.apply(name, w).to(w.dtype)``; exact with power-of-two scales).
    - ``apply(name, w, row0)`` works on row chunks (the converter streams FP8 block rows).
    - ``weight(name)`` / ``quant_params(name)`` read the source through ``weights_fn``.
    - ``stats``: tokens per expert, fallback experts, per-layer seconds, output error and
      peak memory, the scale chosen per mapping, the calibration tokens' sha256.
    """

    options: AwqOptions
    transforms: Mapping[str, Transform]
    quantized: tuple[str, ...]
    stats: dict[str, Any] = field(default_factory=dict)
    weights_fn: Callable[[str], torch.Tensor] | None = None

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.transforms) | set(self.quantized)))

    @property
    def clip_factors(self) -> torch.Tensor:
        return awq.clip_factors(self.options.clip_grid, self.options.clip_max_shrink)

    def __contains__(self, name: object) -> bool:
        return name in self.transforms or name in self.quantized

    def apply(self, name: str, w: torch.Tensor, row0: int = 0) -> torch.Tensor:
        """Transformed ``w`` (source tensor ``name``, or its rows from ``row0``), float32."""
        t = self.transforms.get(name)
        return apply_transform(w, t, self.options.group_size, self.clip_factors, row0)

    def weight(self, name: str) -> torch.Tensor:
        """The transformed tensor ``name``, read through ``weights_fn``: float32."""
        if self.weights_fn is None:
            raise HetquantError("CalibrationResult.weight needs weights_fn (the source)")
        return self.apply(name, self.weights_fn(name))

    def quant_params(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales FP16, zeros) [N, K/g] for ``AwqW4A16.quantize(weight(name), scales=,
        zeros=)`` — the round-to-nearest parameters of the transformed weight."""
        return awq.rtn_params(self.weight(name), self.options.group_size)

    def save(self, path: str | Path) -> Path:
        """Write ``calibration.json`` + one ``layer_XXX.safetensors`` per layer to ``path``."""
        from safetensors.torch import save_file

        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, torch.Tensor]] = {}
        where: dict[str, str] = {}
        for name, t in sorted(self.transforms.items()):
            file = f"layer_{int(name.split('.')[2]):03d}.safetensors"
            where[name] = file
            for key, v in t.tensors().items():
                files.setdefault(file, {})[f"{name}:{key}"] = v
        for file, tensors in files.items():
            tmp = root / f".{file}.tmp"
            save_file(tensors, str(tmp))
            tmp.replace(root / file)
        doc = {
            "format": RESULT_FORMAT,
            "version": RESULT_VERSION,
            "options": self.options.to_dict(),
            "quantized": list(self.quantized),
            "tensors": where,
            "stats": self.stats,
        }
        tmp = root / f".{RESULT_JSON}.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(root / RESULT_JSON)  # written last: its presence marks a complete result
        return root

    @classmethod
    def load(
        cls, path: str | Path, weights_fn: Callable[[str], torch.Tensor] | None = None
    ) -> CalibrationResult:
        """Open a saved result; transforms are read from disk when asked for."""
        root = Path(path)
        try:
            doc = json.loads((root / RESULT_JSON).read_text())
        except FileNotFoundError:
            raise HetquantError(f"{root}: no {RESULT_JSON}; not a (complete) calibration") from None
        if doc.get("format") != RESULT_FORMAT or doc.get("version") != RESULT_VERSION:
            raise HetquantError(f"{root / RESULT_JSON}: not a {RESULT_FORMAT} v{RESULT_VERSION}")
        return cls(
            AwqOptions.from_dict(doc["options"]),
            _StoredTransforms(root, doc["tensors"]),
            tuple(doc["quantized"]),
            doc["stats"],
            weights_fn,
        )


class _StoredTransforms(Mapping[str, Transform]):
    """Transforms of a saved result, read lazily per tensor (memory-mapped safetensors)."""

    def __init__(self, root: Path, where: Mapping[str, str]) -> None:
        self.root, self.where = root, dict(where)
        self._open: dict[str, tuple[Any, set[str]]] = {}

    def __getitem__(self, name: str) -> Transform:
        from safetensors import safe_open

        file = self.where[name]
        if file not in self._open:
            f = safe_open(str(self.root / file), framework="pt")
            self._open[file] = (f, set(f.keys()))
        f, keys = self._open[file]
        got = {k: f.get_tensor(f"{name}:{k}") for k in ("col_mul", "row_div", "shrink")
               if f"{name}:{k}" in keys}  # fmt: skip
        return Transform(**got)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


# -- calibration -----------------------------------------------------------------------------


def calibrate(
    source: Any,
    tokens: torch.Tensor,
    options: AwqOptions | None = None,
    *,
    device: str | torch.device | None = None,
    weights_fn: Callable[[str], torch.Tensor] | None = None,
    names: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> CalibrationResult:
    """Calibrate ``source`` on ``tokens`` [N, T] (see module docstring).

    ``source``: anything with ``.config`` (a ``ModelConfig``) and ``.tensors`` (names), and —
    unless ``weights_fn(name) -> tensor`` is given — ``.weight(name)`` / ``.scale(name)``.
    ``names`` overrides the tensor names. Deterministic: same inputs, same device type → same
    transforms (bit-identical on the CPU).
    """
    opts = options or AwqOptions()
    cfg = source.config
    names = list(names if names is not None else source.tensors)
    fn = weights_fn or source_tensor_fn(source)
    dev = torch.device(device) if device is not None else default_device()
    tokens = check_tokens(tokens, cfg.vocab_size)
    quantized = tuple(n for n in names if is_quantized_linear(n, cfg.num_hidden_layers))
    ctx = _Context(cfg, opts, dev, opts.compute_dtype(dev), tokens.shape[1])
    start = time.perf_counter()
    transforms: dict[str, Transform] = {}
    layer_stats = []
    with torch.inference_mode():
        h = ctx.runner.embed(fn("model.embed_tokens.weight"), tokens)  # [N, T, D]
        for layer in range(cfg.num_hidden_layers):
            rss_reset = _reset_peak_rss()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            state = {n: fn(n).to(dev) for n in layer_names(names, layer)}
            h, tf, st = _LayerCalibration(ctx, layer, state, set(quantized)).run(h)
            transforms.update({n: t.to("cpu") for n, t in tf.items()})
            del state
            st["seconds"] = round(time.perf_counter() - t0, 3)
            st["peak_rss_bytes"] = _peak_rss()
            st["peak_rss_is_per_layer"] = rss_reset
            if dev.type == "cuda":
                st["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(dev))
            layer_stats.append(st)
            if log:
                log(f"layer {layer}: {st['seconds']:.1f}s, rel. output error {st['rel_err']:.4g}")
    stats = {
        "method": opts.method,
        "device": str(dev),
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "tokens": {
            "samples": tokens.shape[0],
            "seq_len": tokens.shape[1],
            "sha256": tokens_digest(tokens),
        },
        "seconds": round(time.perf_counter() - start, 3),
        "peak_rss_bytes": max((s["peak_rss_bytes"] or 0) for s in layer_stats)
        if layer_stats
        else None,
        "layers": layer_stats,
    }
    return CalibrationResult(opts, transforms, quantized, stats, fn)


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
    """Steps 2-5 of the module docstring for one layer."""

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


# -- memory ------------------------------------------------------------------------------------


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    """Peak resident set size (VmHWM) in bytes, or None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
