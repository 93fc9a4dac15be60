"""A decoder layer's weights as calibration and evaluation hold them, and what its linears see.

``LayerWeights`` is the weights provider (``runtime.model.Weights``) over one layer's state (HF
names → tensors on the compute device); with a ``Capture`` it records the input of every
non-expert linear and, for the MoE, the router's expert choice, from which each routed expert's
own tokens are recovered (``Capture.expert_tokens``). Routed experts add their contributions with
an index-put per top-k slot, not ``index_add_`` (``calib/forward.py``'s docstring says why).
``layer_names`` picks a layer's tensor names, ``source_tensor_fn`` reads a source checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelFamily
from hetquant.runtime.forward.model import DenseWeights
from hetquant.runtime.forward.moe import gated_mlp

__all__ = ["Capture", "LayerWeights", "TensorFn", "layer_names", "source_tensor_fn"]

TensorFn = Callable[[str], torch.Tensor]


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


class LayerWeights(DenseWeights):
    """``runtime.model.Weights`` over ``state`` (HF names → tensors on the compute device) of a
    model of ``family`` (``get`` and ``embed`` are ``DenseWeights``'). Routed experts run through
    ``experts`` only: their inputs are not captured (the routing is) and their weights not kept
    in the compute dtype."""

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        capture: Capture | None = None,
        *,
        family: ModelFamily,
    ):
        super().__init__(state, family)
        self.capture = capture
        self._cast: dict[str, torch.Tensor] = {}  # non-expert weights in the compute dtype

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
