"""vLLM's module names against the artifact's: the model class's ``hf_to_vllm_mapper``, inverted.

vLLM names its layers after its own module tree, and renames the checkpoint's tensors into it
with the model class's ``hf_to_vllm_mapper`` (``vllm/model_executor/models/utils.py``
``WeightsMapper``), which it hands the quantization config before building the layers
(``apply_vllm_mapper``: ``model_loader/utils.py:379``, ``models/interfaces.py:1258``). Where the
artifact keeps the source's own names, the two differ: DeepSeek-V4's checkpoint stores
``layers.0.attn.wq_a`` and ``layers.0.ffn.shared_experts.w2``, vLLM builds
``model.layers.0.attn.wq_a`` and ``model.layers.0.ffn.shared_experts.down_proj``
(``models/deepseek_v4/cpu/model.py`` ``_make_deepseek_v4_weights_mapper``). A mapper renames
tensors, so a module ``m`` maps as its tensor ``m.weight`` does.

Routed experts stored in ``cpu_experts/`` are no module of the root part; their layer is found
from the family's role table (``ModelFamily.stacked_experts``: the experts' module up to the
expert index, e.g. ``layers.0.ffn.experts``), mapped the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..loading.loader import Artifact

__all__ = ["VllmNames"]

Rename = Callable[[str], "str | None"]  # a tensor name → vLLM's (None: not loaded)


def _module(rename: Rename, module: str) -> str | None:
    mapped = rename(f"{module}.weight")
    return mapped.removesuffix(".weight") if mapped and mapped.endswith(".weight") else None


class VllmNames:
    """The artifact's module names as vLLM names them (identity without a mapper)."""

    def __init__(self, art: Artifact, rename: Rename | None = None) -> None:
        self.stored_of: dict[str, str] = {}  # vLLM module → stored module
        self.experts_of: dict[str, int] = {}  # vLLM routed-experts module → its MoE layer
        family = art.cfg.family
        for stored in art.modules:
            vllm = _module(rename, stored) if rename is not None else stored
            if vllm is not None and vllm != stored:
                self.stored_of.setdefault(vllm, stored)
        for layer in range(art.cfg.total_layers):
            if art.cfg.is_moe_layer(layer):
                self._add_experts(family, layer, rename)

    def _add_experts(self, family: Any, layer: int, rename: Rename | None) -> None:
        stacked = family.stacked_experts(layer)
        if stacked is None:
            return
        vllm = _module(rename, stacked) if rename is not None else stacked
        if vllm is not None:
            self.experts_of[vllm] = layer

    def stored(self, module: str, known: Any = ()) -> str:
        """The stored name of vLLM's ``module``: itself where the artifact has it (``known``),
        else the mapper's inverse, else itself (a module the artifact does not store)."""
        if module in known:
            return module
        return self.stored_of.get(module, module)

    def experts_layer(self, prefix: str) -> int | None:
        """The MoE layer of vLLM's routed-experts module ``prefix`` (None: not one the role
        table stacks, or stored under vLLM's own name)."""
        return self.experts_of.get(prefix)
