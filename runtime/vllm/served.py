"""The artifact vLLM serves: a local hetquant artifact of a schema we read, or one line why not.

No vLLM import here: the refusals are tested without vLLM.
"""

from __future__ import annotations

from pathlib import Path

from hetquant.formats import HetquantError
from hetquant.formats.filenames import MANIFEST_NAME, READABLE_SCHEMAS

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
    art = open_artifact(root)
    schema = art.manifest.get("schema_version")
    if schema not in READABLE_SCHEMAS:
        raise HetquantError(
            f"--quantization {NAME}: {root / MANIFEST_NAME} has schema_version {schema!r}; "
            f"this hetquant reads {', '.join(map(str, READABLE_SCHEMAS))} (convert it again)"
        )
    return art
