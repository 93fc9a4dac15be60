"""The reference forward of each model family, by family name (a vision-language family's is its
text family's: the text path, ``formats/families/vlm.py``): what ``hetquant run`` / ``eval``,
``local_model`` and calibration's layer runner build for an artifact or source.

A new family registers its forward here (a ``model.DecoderReference`` subclass).
"""

from __future__ import annotations

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig
from hetquant.formats.families.vlm import VlmFamily

from .deepseek_v4 import DeepseekV4Reference
from .model import DecoderReference, DeepseekV3Reference, check_runnable
from .qwen3_moe import Qwen3MoeReference

__all__ = ["REFERENCES", "reference_for"]

REFERENCES: dict[str, type[DecoderReference]] = {
    "deepseek_v3": DeepseekV3Reference,
    "deepseek_v4": DeepseekV4Reference,
    "deepseek_v4_hf": DeepseekV4Reference,  # transformers' on-disk layout of the same model
    "qwen3_moe": Qwen3MoeReference,
}


def reference_for(cfg: ModelConfig) -> type[DecoderReference]:
    """The reference forward class of ``cfg``'s model family (refused, with the family's own
    reason, where its forward would leave part of the model out)."""
    check_runnable(cfg)
    family = cfg.family  # a VLM runs its text path: its text family's forward
    name = family.spec.text if isinstance(family, VlmFamily) and family.spec else family.name
    try:
        return REFERENCES[name]
    except KeyError:
        raise HetquantError(
            f"model family {cfg.family_name!r} has no reference forward (runtime/forward/references.py); "
            "it converts, but run, eval and AWQ calibration need one"
        ) from None
