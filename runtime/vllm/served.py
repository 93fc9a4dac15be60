"""The artifact vLLM serves: a local hetquant artifact of a schema we read, or one line why not.

No vLLM import here: the refusals are tested without vLLM.
"""

from __future__ import annotations

from pathlib import Path

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME

from ..loading.loader import Artifact, open_artifact

__all__ = ["NAME", "open_served"]

NAME = "hetquant"  # the quantization method and the load format


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
