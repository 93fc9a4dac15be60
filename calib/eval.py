"""Accuracy of an artifact against its FP8 source: perplexity, KL divergence, top-1 agreement.

``evaluate(artifact_forward, reference_forward, tokens)`` takes two forwards — callables token
ids [N, T] → logits float32 [N, T, V] — and held-out tokens [N, T] (``data.token_blocks``). Over
every position t < T - 1 of every sequence (the positions that have a next token):

- ``ppl`` / ``ref_ppl``: ``exp(mean_t -log p(tokens[t + 1] | tokens[≤ t]))`` of each model;
- ``kl``: ``mean_t KL(p_ref,t || p_art,t) = Σ_v p_ref log(p_ref / p_art)`` in nats;
- ``top1``: fraction of positions where both models' most likely next token agree.

Forwards provided here (all stream one decoder layer's tensors at a time, ``forward.py``):

- ``reference_forward_from_source(source)``: the FP8 checkpoint, weights dequantized with
  DeepSeek's formula, computed in float32;
- ``forward_from_artifact_dequantized(artifact_dir)``: every stored tensor of an artifact
  dequantized with its format's ``dequantize`` (routed experts in ``cpu_experts/`` too), then the
  same float forward. A fallback until the runtime's quantized ops land: it reproduces the
  weights exactly but NOT activation quantization (W8A8_DYNAMIC's per-token int8 inputs are
  not applied; for weight-only formats — awq_w4a16, int4, nvfp4 weights — nothing is missing
  except the kernels' own accumulation order);
- ``forward_from_calibration(source, result)``: what a converter writes from a
  ``CalibrationResult`` (each transformed linear quantized in its target format and dequantized;
  folded norms and routers in their source dtype), without writing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import parse_config

from .calibrate import CalibrationResult
from .forward import StreamedForward, source_tensor_fn

__all__ = [
    "ArtifactTensors",
    "eval_peak_bytes",
    "evaluate",
    "forward_from_artifact_dequantized",
    "forward_from_calibration",
    "per_sequence",
    "reference_forward_from_source",
]

Forward = Callable[[torch.Tensor], torch.Tensor]


def evaluate(
    artifact_forward: Forward, reference_forward: Forward, tokens: torch.Tensor
) -> dict[str, float]:
    """``{"ppl", "ref_ppl", "kl", "top1", "positions"}`` (see module docstring)."""
    t = tokens.to(torch.long)
    if t.ndim != 2 or t.shape[1] < 2:
        raise HetquantError(f"evaluate: expected tokens [N, T >= 2], got {list(t.shape)}")
    ref = reference_forward(t)
    art = artifact_forward(t)
    want = (t.shape[0], t.shape[1])
    for what, lg in (("reference", ref), ("artifact", art)):
        if lg.ndim != 3 or tuple(lg.shape[:2]) != want:
            raise HetquantError(f"evaluate: {what} logits {list(lg.shape)}, expected [N, T, V]")
    nll_ref = nll_art = kl = agree = 0.0
    for n in range(t.shape[0]):  # one sequence at a time: [T-1, V] temporaries
        lr = torch.log_softmax(ref[n, :-1].to(torch.float64), -1)
        la = torch.log_softmax(art[n, :-1].to(torch.float64), -1)
        tgt = t[n, 1:, None]
        nll_ref -= float(lr.gather(1, tgt).sum())
        nll_art -= float(la.gather(1, tgt).sum())
        kl += float((lr.exp() * (lr - la)).sum())
        agree += float((lr.argmax(-1) == la.argmax(-1)).sum())
    count = t.shape[0] * (t.shape[1] - 1)
    return {
        "ppl": math.exp(nll_art / count),
        "ref_ppl": math.exp(nll_ref / count),
        "kl": kl / count,
        "top1": agree / count,
        "positions": count,
    }


def eval_peak_bytes(config: Mapping[str, Any], samples: int, seq_len: int) -> int:
    """Estimated peak memory, in bytes, of ``evaluate`` over ``samples`` × ``seq_len`` tokens
    with the forwards of this module and ``per_sequence`` (weights not counted: they are
    memory-mapped or streamed a layer at a time). T = ``seq_len``, N = ``samples``:

    - attention, one sequence at a time: the causal mask [T, T] and three [H, T, T] float32
      temporaries (scores, masked scores, probabilities) — quadratic in T, what runs out first;
    - both models' logits [N, T, V] float32, the artifact's twice (stacked from a list);
    - ``evaluate``'s five float64 [T - 1, V] temporaries of one sequence.
    """
    t, n = int(seq_len), int(samples)
    heads, vocab = int(config["num_attention_heads"]), int(config["vocab_size"])
    attention = 4 * t * t * (1 + 3 * heads)
    logits = 4 * 3 * n * t * vocab + 8 * 5 * t * vocab
    return attention + logits


def per_sequence(forward: Callable[[torch.Tensor], torch.Tensor]) -> Forward:
    """Adapt a one-sequence forward ([T] → [T, V], e.g. ``DeepseekV3Reference``) to [N, T]."""

    def run(tokens: torch.Tensor) -> torch.Tensor:
        return torch.stack([forward(row).to(torch.float32) for row in tokens])

    return run


def reference_forward_from_source(
    source: Any,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    weights_fn: Callable[[str], torch.Tensor] | None = None,
) -> StreamedForward:
    """The FP8 source as a forward (``source``: ``.config``, ``.tensors``, ``.weight``/``.scale``)."""
    fn = weights_fn or source_tensor_fn(source)
    return StreamedForward(source.config, source.tensors, fn, device=device, dtype=dtype)


def forward_from_calibration(
    source: Any,
    result: CalibrationResult,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    weights_fn: Callable[[str], torch.Tensor] | None = None,
) -> StreamedForward:
    """The artifact a converter writes from ``result``, without writing it (module docstring)."""
    fn = weights_fn or result.weights_fn or source_tensor_fn(source)
    quantized = set(result.quantized)

    def get(name: str) -> torch.Tensor:
        w = fn(name)
        if name in quantized:
            fmt = result.quantizer(name).fmt
            return fmt.dequantize(fmt.quantize(result.apply(name, w)))
        if name in result.transforms:
            return result.apply(name, w).to(w.dtype)
        return w

    return StreamedForward(source.config, source.tensors, get, device=device, dtype=dtype)


class ArtifactTensors:
    """``name → float tensor`` over an artifact: each module dequantized with its format.

    Names are the source's; routed experts stored stacked in ``cpu_experts/`` answer to their
    per-expert names (the model family's). Reads are memory-mapped, per tensor.
    """

    def __init__(self, root: str | Path) -> None:
        from hetquant.runtime import open_artifact

        self.root = Path(root)
        art = open_artifact(self.root)
        self.config = art.config
        self.family = parse_config(art.config).family
        self._where: dict[str, tuple] = {}
        for info in art.modules.values():
            if info.fmt is not None:
                self._where[f"{info.prefix}.weight"] = ("module", info)
            else:
                for key, (file, entry) in info.entries.items():
                    self._where[f"{info.prefix}.{key}"] = ("plain", file, entry.name)
        for layer, path in sorted(art.cpu_expert_files.items()):
            self._add_cpu_experts(layer, path)
        self._files: dict[str, Any] = {}
        self._expert: tuple[tuple[Path, int], tuple[torch.Tensor, ...]] | None = None

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def _add_cpu_experts(self, layer: int, path: Path) -> None:
        from hetquant.formats.safetensors_io import read_header

        entries = read_header(path).entries
        packed = [n for n in entries if n.endswith(".gate_up_packed")]
        for name in packed:
            prefix = name.removesuffix(".gate_up_packed")
            loc = self.family.locate(prefix)
            if loc is None or loc.role is not None or loc.layer is None:
                raise HetquantError(f"{path}: {prefix} is not a layer's stacked routed experts")
            mlp = self.family.mlp("routed")
            for e in range(entries[name].shape[0]):
                for i, role in enumerate((mlp.gate, mlp.up, mlp.down)):  # type: ignore[union-attr]
                    where = ("cpu", path, prefix, e, i)
                    self._where[self.family.tensor(role, loc.layer, e)] = where

    def _open(self, file: str | Path) -> Any:
        from safetensors import safe_open

        key = str(file)
        if key not in self._files:
            self._files[key] = safe_open(str(self.root / file), framework="pt")
        return self._files[key]

    def _read(self, file: str | Path, name: str) -> torch.Tensor:
        return self._open(file).get_tensor(name)

    def __call__(self, name: str) -> torch.Tensor:
        where = self._where.get(name)
        if where is None:
            raise HetquantError(f"{self.root}: the artifact stores no tensor {name!r}")
        kind = where[0]
        if kind == "plain":
            return self._read(where[1], where[2])
        if kind == "module":
            info = where[1]
            local = {k: self._read(f, e.name) for k, (f, e) in info.entries.items()}
            return info.fmt.dequantize(local)
        return self._cpu_expert(*where[1:])

    def _cpu_expert(self, path: Path, prefix: str, e: int, part: int) -> torch.Tensor:
        """Part ``part`` (0 gate, 1 up, 2 down) of expert ``e`` of the stacked ``prefix``."""
        from hetquant.formats.int4_cpu import LAYER_KEYS, dequantize_expert

        if self._expert is None or self._expert[0] != (path, e):
            f = self._open(path)  # expert e's slice of each stacked tensor only
            layer = {k: f.get_slice(f"{prefix}.{k}")[e : e + 1] for k in LAYER_KEYS}
            self._expert = ((path, e), dequantize_expert(layer, 0))
        return self._expert[1][part]


def forward_from_artifact_dequantized(
    artifact_dir: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    config: Any = None,
) -> StreamedForward:
    """An artifact as a forward, every stored tensor dequantized (module docstring: no
    activation quantization). ``config``: the parsed config.json (default: the artifact's,
    parsed by its family)."""
    tensors = ArtifactTensors(artifact_dir)
    cfg = config if config is not None else parse_config(tensors.config)
    return StreamedForward(cfg, tensors.names, tensors, device=device, dtype=dtype)
