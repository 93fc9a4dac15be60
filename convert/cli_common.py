"""Helpers the command modules share (``cli``, ``run_cli``), kept apart so neither imports the other."""

from __future__ import annotations

from pathlib import Path

from hetquant.formats import HetquantError

__all__ = ["must_exist"]


def must_exist(path: Path) -> None:
    """Refuse a missing PATH argument with one ``error:`` line."""
    if not path.exists():
        raise HetquantError(f"{path}: no such file or directory")
