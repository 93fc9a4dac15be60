"""hetquant.convert: checkpoints into artifacts — plan → validate → execute, export, publish.

Callers import names from here, not module paths; each loads its room on first use (the CLI
starts without torch, a verify without the engine). The rooms, bottom up:

- ``recipes/``: what becomes of each source tensor (``Recipe``, ``Target``, the registry);
- ``fs/``: OUTPUT's lock, the work directory, the source guard, disk space, OS errors;
- ``hub/``: a Hub source, the Hub's limits, upload, the model card;
- ``planning/``: the source checkpoint, the plan, the output containers;
- ``engine/``: executing a plan on OUTPUT held as a transaction, the manifest, calibration;
- ``export/``: CPU experts into another engine's layout, on the same transaction (its own face:
  ``from hetquant.convert.export import export``, the package's name being taken);
- ``cli/``: the click commands; ``inspect`` and ``verify`` beside them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine.calibration import (
        CALIB_OPTIONS,
        calibrate_for,
        calibration_record,
        calibration_targets,
    )
    from .engine.convert import ConvertResult, convert
    from .engine.manifest import digest_files, file_digest, precision_table
    from .hub import resolve_source
    from .planning.plan import Plan, SourceItem, make_plan, parse_size, plan_for
    from .planning.source import SourceCheckpoint
    from .recipes import RECIPES, Recipe, Target, get_recipe, keep
    from .verify import replay_plan, verify_artifact

_WHERE = {
    ".engine.calibration": ("CALIB_OPTIONS", "calibrate_for", "calibration_record",
                            "calibration_targets"),
    ".engine.convert": ("ConvertResult", "convert"),
    ".engine.manifest": ("digest_files", "file_digest", "precision_table"),
    ".hub": ("resolve_source",),
    ".planning.plan": ("Plan", "SourceItem", "make_plan", "parse_size", "plan_for"),
    ".planning.source": ("SourceCheckpoint",),
    ".recipes": ("RECIPES", "Recipe", "Target", "get_recipe", "keep"),
    ".verify": ("replay_plan", "verify_artifact"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "CALIB_OPTIONS",
    "RECIPES",
    "ConvertResult",
    "Plan",
    "Recipe",
    "SourceCheckpoint",
    "SourceItem",
    "Target",
    "calibrate_for",
    "calibration_record",
    "calibration_targets",
    "convert",
    "digest_files",
    "file_digest",
    "get_recipe",
    "keep",
    "make_plan",
    "parse_size",
    "plan_for",
    "precision_table",
    "replay_plan",
    "resolve_source",
    "verify_artifact",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hetquant.convert' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
