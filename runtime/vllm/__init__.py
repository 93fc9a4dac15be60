"""vLLM plugin: ``--quantization hetquant --load-format hetquant`` serves hetquant artifacts.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API server,
engine core, workers; ``vllm/plugins/__init__.py:18``, ``load_general_plugins``); ours is
:func:`register`, which registers

- the quantization method ``hetquant`` (``config.py``): its description is the artifact's own
  ``hetquant.json`` (the manifest's ``module_formats``), nothing hand-edited; linear layers get a
  method per stored format (``linear.py``), MoE layers one per expert format (``moe.py``; a
  hybrid's ``cpu_experts/`` run in our CPU expert pool);
- the load format ``hetquant`` (``loader.py``): each rank reads only its own bytes through
  ``open_artifact(path).load(ParallelLayout(tp_size, tp_rank))``, and a vLLM parameter left
  unfilled fails the load naming it.

Nothing here imports vLLM until :func:`register` runs, so hetquant works without it.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the quantization config and the model loader with vLLM (idempotent: vLLM may
    call it several times in one process)."""
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from .config import NAME, HetquantConfig
    from .loader import HetquantModelLoader

    register_quantization_config(NAME)(HetquantConfig)
    register_model_loader(NAME)(HetquantModelLoader)
