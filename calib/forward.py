"""Decoder layers over a batch of sequences, one layer's weights at a time.

Calibration and evaluation both run the model as ``N`` independent sequences of ``T`` tokens
(positions 0..T-1 each, causal), layer by layer: only the current layer's tensors are held, as
``DenseWeights``-style state on the compute device, plus the hidden states [N, T, D]. The layer
is composed from the runtime's own building blocks (the family's reference forward,
``runtime/forward/references.py``: its ``attention``; ``rms_norm``; ``runtime/forward/moe.py``
``route``, ``gated_mlp``), in the order of ``DecoderReference.decoder_layer``, with two changes that make it run on any
device and deterministically:

- attention runs per sequence (the runtime's attention takes one sequence); norms, router and
  MLP / experts run on all N·T tokens at once;
- ``route`` runs on the CPU (its group mask is allocated there), and the routed-expert sum adds
  each expert's contribution with an index-put per top-k slot instead of ``index_add_`` —
  identical on the CPU (tokens are unique per expert and slot; a hash-routed token may take one
  expert in two slots), and free of CUDA's atomic-add nondeterminism.

``LayerWeights`` is the weights provider (``runtime.model.Weights``); with a ``Capture`` it
records the input of every non-expert linear and, for the MoE, the router's expert choice, from
which each routed expert's own tokens are recovered (``Capture.expert_tokens``).

``StreamedForward(cfg, names, tensor_fn)`` is the whole model this way: tokens [N, T] → logits
float32 [N, T, V], reading each tensor through ``tensor_fn(name)`` when its layer comes up.
``cfg`` is the model's config (``formats.families``); every tensor name comes from its family's
role table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelFamily
from hetquant.runtime.forward.model import rms_norm
from hetquant.runtime.forward.moe import gated_mlp, route
from hetquant.runtime.forward.precision import work_dtype
from hetquant.runtime.forward.references import reference_for
from hetquant.runtime.forward.rope import cos_sin

__all__ = [
    "Capture",
    "LayerRunner",
    "LayerWeights",
    "StreamedForward",
    "available_device",
    "check_tokens",
    "default_device",
    "layer_names",
    "source_tensor_fn",
]

TensorFn = Callable[[str], torch.Tensor]


def default_device() -> torch.device:
    """``cuda`` if available, else ``npu`` (torch_npu loaded and a device present), else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")


def available_device(device: str | torch.device | None) -> torch.device:
    """``device`` (default :func:`default_device`), refused in one line when this machine has
    none of that type."""
    if device is None:
        return default_device()
    dev = torch.device(device)
    backend = getattr(torch, dev.type, None)
    if dev.type != "cpu" and (backend is None or not backend.is_available()):
        raise HetquantError(f"calibration device {dev.type}: none is available here; use cpu")
    return dev


def source_tensor_fn(source: Any) -> TensorFn:
    """``name → tensor`` of a source checkpoint (anything with ``.dequantized(name)``): weights
    in a quantized source format dequantized exactly to BF16 by that format (FP8 blocks with
    DeepSeek's formula), other tensors as stored (zero-copy views; never written)."""
    return source.dequantized


def layer_names(names: Iterable[str], layer: int, family: ModelFamily) -> list[str]:
    """The tensor names of decoder layer ``layer`` (under ``family.layer_prefix``), in order."""
    prefix = family.layer_prefix.format(layer=layer)
    return [n for n in names if n.startswith(prefix)]


class Capture:
    """Inputs seen by a layer's linears during one forward (see module docstring)."""

    def __init__(self) -> None:
        self._inputs: dict[str, list[torch.Tensor]] = {}
        self._joined: dict[tuple[int, ...], torch.Tensor] = {}
        self.moe_input: torch.Tensor | None = None  # [M, D], the normed input of the MoE
        self.topk_ids: torch.Tensor | None = None  # [M, k]

    def linear(self, name: str, x: torch.Tensor) -> None:
        self._inputs.setdefault(name, []).append(x)

    def routing(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Record a MoE call; a family run one sequence at a time makes one per sequence."""
        if self.moe_input is not None and self.topk_ids is not None:
            x, topk_ids = torch.cat([self.moe_input, x]), torch.cat([self.topk_ids, topk_ids])
        self.moe_input, self.topk_ids = x, topk_ids

    def input(self, module: str) -> torch.Tensor:
        """Every row linear ``module`` saw, [rows, in] (one tensor shared by linears that read
        the same activations)."""
        parts = self._inputs.get(module)
        if not parts:
            raise HetquantError(f"calibration: linear {module} saw no input")
        key = tuple(id(p) for p in parts)
        if key not in self._joined:
            self._joined[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._joined[key]

    def expert_tokens(self, n_experts: int) -> list[torch.Tensor]:
        """Per routed expert, the (ascending) rows of ``moe_input`` routed to it."""
        if self.topk_ids is None:
            raise HetquantError("calibration: no routing was captured")
        return [
            torch.nonzero((self.topk_ids == e).any(-1), as_tuple=True)[0] for e in range(n_experts)
        ]


class LayerWeights:
    """``runtime.model.Weights`` over ``state`` (HF names → tensors on the compute device) of a
    model of ``family``. Routed experts run through ``experts`` only: their inputs are not
    captured (the routing is) and their weights not kept in the compute dtype."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        capture: Capture | None = None,
        *,
        family: ModelFamily,
    ):
        self.state, self.capture, self.family = dict(state), capture, family
        self._cast: dict[str, torch.Tensor] = {}  # non-expert weights in the compute dtype

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.state[name]
        except KeyError:
            raise HetquantError(f"weights: no tensor {name!r}") from None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``tokens`` (the family's embedding must be in ``state``)."""
        return self.get(self.family.tensor("embed"))[tokens]

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.capture is not None:
            self.capture.linear(name, x)
        return F.linear(x, self.weight(f"{name}.weight", x.dtype))

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``get(name)`` in ``dtype``; kept for the non-expert linears, which attention calls
        once per sequence (a routed expert runs once per forward)."""
        w = self._cast.get(name)
        if w is None or w.dtype != dtype:
            w = self._cast[name] = self.get(name).to(dtype)
        return w

    def experts(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        limit: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``runtime.moe.routed_experts`` with a deterministic accumulation (module docstring)."""
        if self.capture is not None:
            self.capture.routing(x, topk_ids)
        out = torch.zeros_like(x)  # [M, D]
        for e in torch.unique(topk_ids).tolist():
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # [n], [n]
            modules = self.family.mlp_modules("routed", layer, e)
            y = gated_mlp(self._expert_linear, modules, x[tok], limit)  # [n, D]
            y = y * topk_weights[tok, slot, None].to(x.dtype)
            for j in torch.unique(slot).tolist():  # a token's slots in order (hash routing may
                on = slot == j  # give one token the same expert twice: index-put per slot)
                out[tok[on]] += y[on]
        return out

    def _expert_linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.get(f"{name}.weight").to(x.dtype))


class LayerRunner:
    """Decoder layers over hidden states [N, T, D] (see module docstring)."""

    def __init__(self, cfg: Any, seq_len: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.device, self.dtype, self.fam = cfg, torch.device(device), dtype, cfg.family
        self.reference = reference_for(cfg)  # the family's forward (its attention)
        probe = self.reference(cfg, LayerWeights({}, family=self.fam), dtype=dtype)
        self.composable, self.limit = probe.composable, probe.limit
        self.eps, self.router = probe.eps, probe.router
        cos, sin = cos_sin(probe.rope, torch.arange(seq_len), work_dtype(dtype))  # [T, dr/2]
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.mask = torch.full((seq_len, seq_len), float("-inf")).triu(1).to(self.device)

    def run(
        self, layer: int, h: torch.Tensor, weights: LayerWeights, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layer ``layer`` on ``h`` [N, T, D] (or [N, ``hidden_shape(T)``]) → the same shape,
        with ``weights``; ``tokens`` [N, T]: the token ids (a family that is not composable may
        read them: DeepSeek-V4's hash routing)."""
        model = self.reference(self.cfg, weights, dtype=self.dtype)
        if not self.composable:  # the family's own layer, one sequence at a time
            ids = tokens if tokens is not None else torch.empty(h.shape[0], 0, dtype=torch.long)
            return torch.stack([model.decoder_layer(layer, hn, *model.context(tn.to(hn.device), hn))
                                for hn, tn in zip(h, ids, strict=True)])  # fmt: skip
        f = self.fam
        ln = weights.get(f.tensor("attn_norm", layer))
        rows = []
        for hn in h:  # attention: one sequence at a time
            x = rms_norm(hn, ln, self.eps)  # [T, D]
            rows.append(hn + model.attention(layer, x, self.cos, self.sin, self.mask))
        flat = torch.stack(rows).reshape(-1, h.shape[-1])  # [N·T, D]
        x = rms_norm(flat, weights.get(f.tensor("ffn_norm", layer)), self.eps)
        if self.cfg.is_moe_layer(layer):
            y = self._moe(weights, layer, x)
        else:
            y = gated_mlp(weights.linear, f.mlp_modules(None, layer), x)
        return (flat + y).reshape(h.shape)

    def _moe(self, w: LayerWeights, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``DecoderReference.moe`` with routing on the CPU."""
        assert self.router is not None
        f = self.fam
        wd = work_dtype(x.dtype)
        logits = F.linear(x.to(wd), w.get(f.tensor("router", layer)).to(wd))  # [M, E]
        bias = w.get(f.tensor("router_bias", layer)).cpu() if self.router.use_bias else None
        ids, weights = route(logits.cpu(), bias, self.router)  # [M, k] each
        y = w.experts(layer, x, ids.to(x.device), weights.to(x.device))
        shared = f.mlp("shared")
        if shared is not None and f.role(shared.gate) in f.layer_roles(self.cfg, layer):
            y = y + gated_mlp(w.linear, f.mlp_modules("shared", layer), x)
        return y

    def embed(self, embed_weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, T, D] (a family that is not composable: its ``embed_hidden``,
        [N, ``hidden_shape(T)``]) of ``tokens`` [N, T] (looked up where the table lives)."""
        if not self.composable:
            table = LayerWeights({self.fam.tensor("embed"): embed_weight}, family=self.fam)
            model = self.reference(self.cfg, table, dtype=self.dtype)
            ids = tokens.to(embed_weight.device)
            return torch.stack([model.embed_hidden(t) for t in ids]).to(self.device)
        return embed_weight[tokens.to(embed_weight.device)].to(self.device, self.dtype)

    def head(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Logits float32 [N, T, V] from the last hidden states ``h`` [N, T, D]."""
        x = rms_norm(h, norm.to(self.device), self.eps)
        return F.linear(x, lm_head.to(self.device, self.dtype)).to(torch.float32)


def check_tokens(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """``tokens`` as int64 [N, T] (a 1-D sequence becomes N = 1), ids checked against vocab."""
    t = tokens.to(torch.long)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.numel() == 0:
        raise HetquantError(f"expected token ids [N, T], got shape {list(tokens.shape)}")
    if int(t.min()) < 0 or int(t.max()) >= vocab:
        raise HetquantError(f"token ids must lie in [0, {vocab})")
    return t


class StreamedForward:
    """Tokens [N, T] → logits float32 [N, T, V], one decoder layer's tensors at a time.

    ``names``: every tensor name available; ``tensor_fn(name)``: that tensor (float, any
    device). Each layer's tensors are moved to ``device`` and dropped after the layer.
    """

    def __init__(
        self,
        cfg: Any,
        names: Iterable[str],
        tensor_fn: TensorFn,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg, self.names, self.tensor_fn = cfg, list(names), tensor_fn
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        t = check_tokens(tokens, self.cfg.vocab_size)
        runner, f = LayerRunner(self.cfg, t.shape[1], self.device, self.dtype), self.cfg.family
        if not runner.composable:
            return self._per_sequence(runner, t)
        h = runner.embed(self.tensor_fn(f.tensor("embed")), t)  # [N, T, D]
        for layer in range(self.cfg.num_hidden_layers):
            names = layer_names(self.names, layer, f)
            state = {n: self.tensor_fn(n).to(self.device) for n in names}
            h = runner.run(layer, h, LayerWeights(state, family=f))
            del state
        return runner.head(
            h, self.tensor_fn(f.tensor("final_norm")), self.tensor_fn(f.tensor("lm_head"))
        ).cpu()

    def _per_sequence(self, runner: LayerRunner, t: torch.Tensor) -> torch.Tensor:
        """The forward of a family whose layers ``LayerRunner`` does not compose: the family's
        own embedding, layers and head, one sequence at a time, one layer's tensors at a time."""
        f, cfg = self.cfg.family, self.cfg
        prefixes = tuple(f.prefix(layer) for layer in range(cfg.total_layers))
        top = {n: self.tensor_fn(n).to(self.device) for n in self.names
               if not n.startswith(prefixes)}  # fmt: skip
        model = runner.reference(cfg, LayerWeights(top, family=f), dtype=self.dtype)
        h = runner.embed(top[f.tensor("embed")], t)  # [N, T, ...]
        t = t.to(self.device)
        for layer in range(cfg.num_hidden_layers):
            names = [n for n in self.names if n.startswith(f.prefix(layer))]
            state = {n: self.tensor_fn(n).to(self.device) for n in names}
            h = runner.run(layer, h, LayerWeights(state, family=f), t)
            del state
        return torch.stack([model.head(hn) for hn in h]).cpu()
