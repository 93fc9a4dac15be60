"""The artifact vLLM serves: a local hetquant artifact of a schema we read, or one line why not.

No vLLM import here: the refusals are tested without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME

from ..loading.loader import Artifact, open_artifact

__all__ = ["KERNELS", "KERNELS_ENV", "NAME", "kernel_choice", "open_served"]

NAME = "hetquant"  # the quantization method and the load format
KERNELS_ENV = "HETQUANT_VLLM_KERNELS"
KERNELS = {
    "vllm": "vLLM's own kernel where it has one for the format on this device, ours otherwise",
    "hetquant": "ours for every layer: the arithmetic of `hetquant run`, so its greedy tokens",
}
"""Which kernels the plugin's methods run (``HETQUANT_VLLM_KERNELS``; default ``vllm``)."""


def kernel_choice(env: Mapping[str, str] = os.environ) -> str:
    """``HETQUANT_VLLM_KERNELS`` (``vllm`` when unset), or one line naming the legal values."""
    choice = env.get(KERNELS_ENV, "vllm")
    if choice not in KERNELS:
        raise HetquantError(
            f"{KERNELS_ENV}={choice!r}: give one of {', '.join(KERNELS)} "
            f"({'; '.join(f'{k}: {v}' for k, v in KERNELS.items())})"
        )
    return choice


def open_served(model: str | Path) -> Artifact:
    """The artifact vLLM was pointed at, or one line saying why it is not one we serve."""
    root = Path(model)
    if not (root / MANIFEST_NAME).is_file():
        raise HetquantError(
            f"--quantization {NAME}: {model} is not a hetquant artifact (no {MANIFEST_NAME}); "
            "give the OUTPUT directory of `hetquant convert` (a local path)"
        )
    try:  # the manifest's schema (formats/manifest_schema.py), shapes against config.json
        return open_artifact(root)
    except HetquantError as e:
        raise HetquantError(f"--quantization {NAME}: {e}") from None
