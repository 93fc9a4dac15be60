"""``hetquant export``: an artifact's CPU experts in another engine's layout (kt-kernel's ``.kt``
files, ...). ``exporters`` is the registry (one class per layout), ``plan`` the shape-only plan
(``hetquant verify`` replays it), ``run`` the execution on the engine's transaction.

Lazy: ``export`` (run.py, which imports the engine) loads on first use, so ``plan`` and
``exporters`` stay light for ``hetquant verify``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import ExportResult, export

__all__ = ["ExportResult", "export"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module 'hetquant.convert.export' has no attribute {name!r}")
