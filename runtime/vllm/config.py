"""``--quantization hetquant``: vLLM's ``QuantizationConfig`` whose description is the artifact.

vLLM builds a quantization config from ``config.json``'s ``quantization_config`` when there is one,
else from the files our ``get_config_filenames()`` names in the model directory
(``vllm/model_executor/model_loader/weight_utils.py:192``, ``get_quant_config``); either way it then
calls ``maybe_update_config(model_dir)`` (``vllm/config/vllm.py:914``). That call is where we read
the artifact — ``hetquant.json`` and the headers, through ``open_artifact`` — so the same path
serves artifacts with and without a ``quantization_config`` (awq-w4a16 and ct-w4a16 carry one for
other engines; ``override_quantization_method`` keeps ``--quantization hetquant`` in charge).

``get_quant_method(layer, prefix)`` maps a vLLM layer to the stored modules it stands for (a fused
layer such as ``gate_up_proj`` to ``gate_proj`` + ``up_proj``, through the model's
``packed_modules_mapping``; vLLM's names turned into the artifact's through the model's
``hf_to_vllm_mapper``, which vLLM hands us in ``apply_vllm_mapper``: ``names.py``) and picks a
method from the registries in ``linear.py`` and ``moe.py`` by their stored format.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME

from ..loading.loader import Artifact
from .linear import DENSE_READ_ROLES, linear_method
from .moe import moe_method
from .names import VllmNames
from .served import NAME, kernel_choice, open_served
from .sources import Source, layer_sources

__all__ = ["NAME", "HetquantConfig", "open_served"]


class HetquantConfig(QuantizationConfig):
    """The artifact's stored formats, as vLLM's quantization config (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.model_dir: str | None = None
        self.kernels = "vllm"  # served.KERNELS; read from the environment with the artifact
        self._artifact: Artifact | None = None  # opened once per process: vLLM pickles us
        self._mapper: Any = None  # the model's hf_to_vllm_mapper (its renames), if it has one
        self._names: VllmNames | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_artifact": None, "_names": None}

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        self._mapper, self._names = hf_to_vllm_mapper, None

    @property
    def names(self) -> VllmNames:
        """vLLM's module names against the artifact's (``names.py``)."""
        if self._names is None:
            rename = self._mapper.map_name if self._mapper is not None else None
            self._names = VllmNames(self.artifact, rename)
        return self._names

    @property
    def artifact(self) -> Artifact:
        if self.model_dir is None:
            raise HetquantError(f"--quantization {NAME}: the artifact was not opened")
        if self._artifact is None:
            self._artifact = open_served(self.model_dir)
        return self._artifact

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # our kernels run on the CPU; vLLM's are chosen only where they run

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [MANIFEST_NAME]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HetquantConfig:
        return cls()  # the artifact is read in maybe_update_config, where its path is known

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        return NAME if user_quant == NAME else None

    def maybe_update_config(
        self, model_name: str, hf_config: Any = None, revision: str | None = None
    ) -> None:
        self._artifact = open_served(model_name)  # refuses a directory we cannot serve
        self.kernels = kernel_choice()
        self.model_dir = str(model_name)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            sources = self._sources(prefix)
            return linear_method(sources, prefix, self.kernels, self._dense_read(sources))
        if isinstance(layer, RoutedExperts):
            return moe_method(self.artifact, prefix, layer, self.kernels, self.names)
        return None

    def _dense_read(self, sources: tuple[Source, ...]) -> bool:
        """Whether vLLM reads this layer's weight itself (``linear.DENSE_READ_ROLES``)."""
        family = self.artifact.cfg.family
        roles = DENSE_READ_ROLES.get(family.name, frozenset())
        return any(
            (loc := family.locate(s.prefix)) is not None and loc.role is not None
            and loc.role.name in roles
            for s in sources
        )  # fmt: skip

    def _sources(self, prefix: str) -> tuple[Source, ...]:
        art, names = self.artifact, self.names
        rename = lambda m: names.stored(m, art.modules)  # noqa: E731
        return layer_sources(art, prefix, self.packed_modules_mapping, rename)
