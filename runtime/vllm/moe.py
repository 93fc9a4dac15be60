"""MoE methods for ``--quantization hetquant``: the routed experts of one layer, given vLLM's
routing (DeepSeek-V3's grouped sigmoid top-k, Qwen3's softmax top-k, DeepSeek-V4's token→expert
table and sqrtsoftplus top-k: vLLM's router decides).

``FusedMoEMethodBase.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)``
(``vllm/model_executor/layers/fused_moe/fused_moe_method_base.py:143``) is called by
``RoutedExperts.forward_modular`` (``routed_experts.py:1346``) after the router chose the experts;
it returns the routed sum ``Σ_k w_k · expert_{id_k}(x)``, [T, H]. Shared experts run before it
(vLLM's ``SharedExpertsOrder.NO_OVERLAP``, our methods have no modular kernel) and vLLM all-reduces
the result over the TP group.

Which method, by where and how the layer's experts are stored (``MOE_METHODS`` by format):

- root part, bf16: vLLM's ``UnquantizedFusedMoEMethod`` (its CPU kernel), loaded by vLLM;
- root part, any other format (ascend-w8a8's W8A8_DYNAMIC, ...): :class:`StoredExpertsMoEMethod`,
  one ``QuantLinear`` per expert projection and ``runtime.forward.moe.routed_experts``;
- ``cpu_experts/`` (ascend-hybrid): :class:`CpuPoolMoEMethod`, the layer in our
  ``CpuExpertPool``, computed on TP rank 0 (the other ranks add zeros), as ``hetquant run`` does,
  with vLLM's SwiGLU clip (``RoutedExperts.swiglu_limit``).

vLLM's experts module (``model.layers.N.ffn.experts`` for DeepSeek-V4) is found in the artifact
through ``names.VllmNames`` (the model's ``hf_to_vllm_mapper`` over the role table's experts
module), else by the family's own names (DeepSeek-V3, Qwen3); :class:`StoredExpertsMoEMethod`
names each expert's projections by the family's role table (V4's ``w1`` / ``w3`` / ``w2``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from hetquant.formats import HetquantError

from ..forward.moe import routed_experts
from ..kernels.ops import QuantLinear
from ..loading.loader import Artifact
from ..parallel.placement import place
from .names import VllmNames
from .sources import Source, expect, shared_format, take

__all__ = ["MOE_METHODS", "POOL", "CpuPoolMoEMethod", "StoredExpertsMoEMethod", "moe_method"]

POOL = "hetquant_pool"  # layer attribute: the CpuExpertPool, set by the loader


class _NoKernelMoE(FusedMoEMethodBase):
    """Our methods: no vLLM modular kernel, no vLLM parameters, no quant config for vLLM's."""

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None

    def _check_parallel(self, prefix: str) -> None:
        if self.moe.moe_parallel_config.use_ep:
            raise HetquantError(
                f"{prefix}: expert parallelism is not supported by the hetquant plugin yet; "
                "serve without --enable-expert-parallel (TP shards every expert)"
            )


Modules = Callable[[int], Sequence[str]]  # expert e → its stored (gate, up, down) module names


class StoredExpertsMoEMethod(_NoKernelMoE):
    """Routed experts stored in the root part in a quantized format, run through our ops;
    ``modules``: each expert's stored projections (the family's role table), ``limit``: vLLM's
    SwiGLU clip."""

    def __init__(
        self, moe: Any, sources: Sequence[Source], prefix: str, modules: Modules,
        limit: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(moe)
        self.sources, self.prefix = tuple(sources), prefix
        self.modules, self.limit = modules, limit
        self._check_parallel(prefix)

    def create_weights(self, layer: Any, num_experts: int, *args: Any, **kwargs: Any) -> None:
        expect(layer, self.sources)

    def process_weights_after_loading(self, layer: Any) -> None:
        tensors = take(layer, self.prefix)
        layer.hetquant_ops = {
            s.prefix: QuantLinear.from_stored(
                str(s.fmt), tensors[s.prefix], backend="cpu", params=s.params
            )
            for s in self.sources
        }

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        ops = layer.hetquant_ops
        return routed_experts(
            lambda m, h: ops[m](h), self.modules, x, topk_ids, topk_weights, self.limit
        )


class CpuPoolMoEMethod(_NoKernelMoE):
    """A hybrid's routed experts of MoE layer ``layer_no``, in our CPU expert pool, on vLLM's
    routing (its router's ``topk_ids`` / ``topk_weights``, the routed scaling in the weights:
    DeepSeek-V4's hash layers and sqrtsoftplus top-k included) and vLLM's SwiGLU clip
    (``RoutedExperts.swiglu_limit``, DeepSeek-V4's ``swiglu_limit``; None: no clip)."""

    def __init__(self, moe: Any, layer_no: int, prefix: str, limit: float | None = None) -> None:
        super().__init__(moe)
        self.layer_no, self.prefix, self.limit = layer_no, prefix, limit
        self._check_parallel(prefix)

    def create_weights(self, layer: Any, num_experts: int, *args: Any, **kwargs: Any) -> None:
        layer.hetquant_pool_layer = self.layer_no

    def process_weights_after_loading(self, layer: Any) -> None:
        if getattr(layer, POOL, None) is None:
            raise HetquantError(
                f"{self.prefix}: its experts are in cpu_experts/, but no CPU expert pool was "
                "opened; load with --load-format hetquant"
            )

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.moe.moe_parallel_config.tp_rank != 0:
            return torch.zeros_like(x)  # rank 0 computes the layer; the all-reduce adds zeros
        pool = getattr(layer, POOL)
        return pool.forward(self.layer_no, x, topk_ids, topk_weights, limit=self.limit)


MoEFactory = Callable[..., FusedMoEMethodBase]  # (moe, sources, prefix, modules, limit)


def _vllm_unquantized(moe: Any, *_: Any) -> FusedMoEMethodBase:
    return UnquantizedFusedMoEMethod(moe)  # vLLM loads it from our tensors (loader.py)


MOE_METHODS: dict[str, MoEFactory] = {"bf16": _vllm_unquantized}
"""Stored expert format → method factory, where one other than ours serves it."""


def moe_method(
    art: Artifact, prefix: str, layer: Any, kernels: str = "vllm", names: VllmNames | None = None
) -> FusedMoEMethodBase:
    """The method of vLLM's ``RoutedExperts`` layer ``prefix`` (``model.layers.N.mlp.experts``);
    ``kernels`` (``served.KERNELS``): ``vllm`` takes ``MOE_METHODS``, ``hetquant`` ours;
    ``names``: vLLM's module names against the artifact's (DeepSeek-V4's differ)."""
    moe, family = layer.moe_config, art.cfg.family
    limit = getattr(layer, "swiglu_limit", None)
    layer_no = names.experts_layer(prefix) if names is not None else None
    if layer_no is None:  # stored under vLLM's own names (DeepSeek-V3, Qwen3)
        layer_no = place(f"{prefix}.0.down_proj", family).layer
    stored = family.stacked_experts(int(layer_no)) if layer_no is not None else None
    under = stored or prefix  # the artifact's experts module (V4: ``layers.N.ffn.experts``)
    sources = [
        Source(info.prefix, info.fmt.name, info.fmt.params)
        for info in art.modules.values()
        if info.prefix.startswith(f"{under}.") and info.fmt is not None
    ]
    if not sources:
        if layer_no in art.cpu_expert_files:
            return CpuPoolMoEMethod(moe, int(layer_no), prefix, limit)
        raise HetquantError(f"{prefix}: the artifact stores no routed experts for this layer")

    def modules(e: int) -> tuple[str, ...]:
        return family.mlp_modules("routed", int(layer_no), e)

    factory: MoEFactory = StoredExpertsMoEMethod  # ours takes each projection's own params
    if (fmt := shared_format(sources)) is not None and kernels == "vllm":
        factory = MOE_METHODS.get(fmt, StoredExpertsMoEMethod)
    return factory(moe, sources, prefix, modules, limit)
