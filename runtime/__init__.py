"""hetquant.runtime: load artifacts sharded for a parallel layout, and run them.

``ParallelLayout`` (layout.py) is light; ``open_artifact`` (loader.py, which imports torch and
the formats) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from .loading.loader import Artifact, open_artifact

__all__ = ["Artifact", "ParallelLayout", "open_artifact"]


def __getattr__(name: str) -> Any:
    if name in ("Artifact", "open_artifact"):
        from .loading import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'hetquant.runtime' has no attribute {name!r}")
