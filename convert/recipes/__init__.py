"""Recipes: what becomes of each source tensor. A small registry keyed by name.

:mod:`.base` holds the contract (``Recipe``, ``Target``, the registry); ``bf16``, ``quantized``
and ``ascend_4bit`` register the recipes; ``metadata`` writes the root part's metadata files and
``serving`` the model card's serving text.
"""

from __future__ import annotations

from . import ascend_4bit, bf16, quantized  # noqa: F401  (registration)
from .base import (
    AS_STORED,
    COPY,
    COPY_TARGET,
    DROP,
    DROP_TARGET,
    RECIPES,
    ROOT,
    Action,
    Recipe,
    Target,
    Written,
    get_recipe,
    keep,
    register_recipe,
)

__all__ = [
    "AS_STORED",
    "COPY",
    "COPY_TARGET",
    "DROP",
    "DROP_TARGET",
    "RECIPES",
    "ROOT",
    "Action",
    "Recipe",
    "Target",
    "Written",
    "get_recipe",
    "keep",
    "register_recipe",
]
