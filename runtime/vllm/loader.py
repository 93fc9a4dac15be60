"""``--load-format hetquant``: each rank reads only its own bytes, and nothing is left unfilled.

vLLM's ``BaseModelLoader`` (``vllm/model_executor/model_loader/base_loader.py:27``) builds the
model, calls ``load_weights(model, model_config)`` and then every layer's
``process_weights_after_loading``. Ours:

1. opens the artifact (``config.open_served``) and reads this rank's tensors with
   ``open_artifact(dir).load(ParallelLayout(tp_size, tp_rank))`` — the shard rules cut every
   tensor as vLLM's layers do (column-parallel out, row-parallel in, vocab rows), and a TP size
   the shapes do not allow is refused there, naming the legal sizes;
2. hands the layers our methods serve (``sources.expect``) their stored tensors, and the CPU
   expert pool (``cpu_experts/``) to the layers whose experts live there;
3. copies the embedding and LM head rows itself (vLLM's vocab loader cuts a whole vocabulary),
   and feeds the rest to the model's own ``load_weights`` (its name mapping: fused ``gate_up_proj``,
   ``fused_qkv_a_proj``, stacked experts), marked as already sharded: ``is_sharded_weight`` for the
   v1 loaders (``linear.py:579``) and ``tp_rank = 0`` for ``BasevLLMParameter``s, whose v2
   loaders narrow by ``tp_rank`` (``parameter.py:145``) — a no-op on a tensor that is this rank's;
4. fails naming every parameter still unfilled: they start as NaN here, and vLLM itself does not
   check a quantized model (``default_loader.py:505``), where an empty one gives NaN logits.

Pool threads and subpools: ``HETQUANT_CPU_THREADS`` (default: torch's threads) and
``HETQUANT_SUBPOOLS`` (default 1), the seeds' ``--cpuinfer`` and ``--subpool-count``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from hetquant.formats import HetquantError

from ..loading.loader import Artifact
from ..parallel.layout import ParallelLayout
from .linear import DENSE_READ, dense_weight
from .moe import POOL
from .served import NAME, open_served
from .sources import SOURCES, TENSORS

__all__ = ["HetquantModelLoader", "pool_options"]

log = logging.getLogger("vllm.hetquant")  # under vLLM's logger: printed as vLLM's INFO lines


def pool_options(env: Any = os.environ) -> dict[str, int]:
    """``CpuExpertPool.open`` options from ``HETQUANT_SUBPOOLS`` / ``HETQUANT_CPU_THREADS``."""
    out = {}
    for key, opt in (("HETQUANT_SUBPOOLS", "subpools"), ("HETQUANT_CPU_THREADS", "threads")):
        if (raw := env.get(key)) is None:
            continue
        if not raw.isdigit() or int(raw) < 1:
            raise HetquantError(f"{key}={raw!r}: give an integer >= 1")
        out[opt] = int(raw)
    return out


class HetquantModelLoader(BaseModelLoader):
    """Loads a hetquant artifact into vLLM's model (module docstring)."""

    def download_model(self, model_config: Any) -> None:
        open_served(model_config.model)  # local artifacts only; refuses anything else

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        if get_pp_group().world_size > 1:
            raise HetquantError(f"--load-format {NAME}: pipeline parallelism is not supported yet")
        art = open_served(model_config.model)
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        tensors = art.load(ParallelLayout(tp_size=tp, tp_rank=rank))
        log.info(
            "hetquant: TP rank %d of %d read %d bytes of %s",
            rank, tp, art.last_load.bytes_read if art.last_load else 0, art.root,
        )  # fmt: skip
        by_module = _by_module(tensors)
        _give_hetquant_layers(model, by_module)
        _give_pool(model, art)
        params = dict(model.named_parameters())
        _mark_unfilled(params.values())
        _load_vocab_shards(model, by_module)
        model.load_weights(_rest(by_module))
        unfilled = [n for n, p in params.items() if _has_nan(p)]
        if unfilled:
            raise HetquantError(
                f"--load-format {NAME}: {len(unfilled)} parameter(s) of vLLM's model got no "
                f"weights from {art.root}: {', '.join(unfilled[:6])}"
                f"{' …' if len(unfilled) > 6 else ''}"
            )


def _by_module(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        prefix, _, key = name.rpartition(".")
        out.setdefault(prefix, {})[key] = t
    return out


def _give_hetquant_layers(model: nn.Module, by_module: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each layer our methods serve gets its stored modules' tensors, but a ``bias``: that is the
    layer's own parameter (vLLM's ``apply`` hands it to the method), left for vLLM's loader with
    the rest (a vision-language model's vision linears have one)."""
    for layer in model.modules():
        for src in getattr(layer, SOURCES, ()):
            if src.prefix in by_module:
                local = by_module.pop(src.prefix)
                if "bias" in local:
                    by_module[src.prefix] = {"bias": local.pop("bias")}
                getattr(layer, TENSORS)[src.prefix] = local
            # a missing one is named by the method's process_weights_after_loading
        if getattr(layer, DENSE_READ, False) and len(getattr(layer, TENSORS)) == len(
            getattr(layer, SOURCES)
        ):
            dense_weight(layer, getattr(layer, TENSORS))  # before vLLM's own hook reads it


def _give_pool(model: nn.Module, art: Artifact) -> None:
    layers = [m for m in model.modules() if hasattr(m, "hetquant_pool_layer")]
    if not layers:
        return
    pool = art.cpu_expert_pool(**pool_options())
    log.info("hetquant: %r serves the routed experts of %d layers", pool, len(layers))
    for layer in layers:
        setattr(layer, POOL, pool)


def _load_vocab_shards(model: nn.Module, by_module: dict[str, dict[str, torch.Tensor]]) -> None:
    """Embedding and LM head rows, copied here: vLLM's ``VocabParallelEmbedding.weight_loader``
    takes the whole vocabulary and cuts this rank's rows itself, whatever the weight is marked
    (``vocab_parallel_embedding.py:515``); ours are this rank's rows already (shard rule
    ``vocab``), and must be exactly the rows vLLM's ``shard_indices`` give the rank."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for name, layer in model.named_modules():
        local = by_module.get(name, {})
        if not isinstance(layer, VocabParallelEmbedding) or "weight" not in local:
            continue
        rows, idx = local.pop("weight"), layer.shard_indices
        want = idx.org_vocab_end_index - idx.org_vocab_start_index
        if rows.shape != (want, layer.weight.shape[1]):
            raise HetquantError(
                f"{name}.weight: this rank's stored rows are {list(rows.shape)}, vLLM's vocab "
                f"shard wants [{want}, {layer.weight.shape[1]}]"
            )
        with torch.no_grad():
            layer.weight[:want].copy_(rows)
            layer.weight[want:].fill_(0)  # vLLM's padding rows, as its own loader leaves them
        if not local:
            del by_module[name]


def _mark_unfilled(params: Any) -> None:
    """NaN in every float parameter (what no loaded weight may hold), and mark each as holding
    this rank's shard already (module docstring, 3)."""
    with torch.no_grad():
        for p in params:
            if p.dtype.is_floating_point:
                p.fill_(float("nan"))
            p.is_sharded_weight = True
            if hasattr(p, "tp_rank"):
                p.tp_rank = 0


def _has_nan(p: torch.Tensor) -> bool:
    return p.dtype.is_floating_point and bool(torch.isnan(p).any())


def _rest(by_module: dict[str, dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, local in by_module.items():
        for key, t in local.items():
            yield (f"{prefix}.{key}" if prefix else key), t  # DeepSeek-V4's ``hc_head_fn``
