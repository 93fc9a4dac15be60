"""The file names an artifact and an HF checkpoint directory are read and written under.

One definition each, for convert (which writes them), runtime (which reads them) and the Hub
code; ``formats`` is the package all of them may import.
"""

from __future__ import annotations

__all__ = ["INDEX_NAME", "MANIFEST_NAME", "PARTIAL_DIR", "READABLE_SCHEMAS", "SINGLE_NAME"]

MANIFEST_NAME = "hetquant.json"  # the artifact manifest, written last (convert/engine/manifest.py)
INDEX_NAME = "model.safetensors.index.json"  # an HF checkpoint's tensor → shard map
SINGLE_NAME = "model.safetensors"  # an HF checkpoint in one file, without an index
PARTIAL_DIR = (
    ".hetquant-partial"  # a convert's work directory inside OUTPUT (convert/engine/convert.py)
)
READABLE_SCHEMAS = (1, 2, 3)  # manifest schema versions verify and the readers (vLLM plugin) accept
