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
records what the layer's linears and router saw (both in ``calib/layer_weights.py``, with
``layer_names`` and ``source_tensor_fn``; re-exported here).

``StreamedForward(cfg, names, tensor_fn)`` is the whole model this way: tokens [N, T] → logits
float32 [N, T, V], reading each tensor through ``tensor_fn(name)`` when its layer comes up.
``cfg`` is the model's config (``formats.families``); every tensor name comes from its family's
role table.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.runtime.forward.model import rms_norm
from hetquant.runtime.forward.moe import gated_mlp, route
from hetquant.runtime.forward.precision import work_dtype
from hetquant.runtime.forward.references import reference_for
from hetquant.runtime.forward.rope import cos_sin

from .layer_weights import Capture, LayerWeights, TensorFn, layer_names, source_tensor_fn

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
