"""A family's AWQ calibration mappings, as data; ``calib/layer.py`` interprets them.

A *balance* is one AWQ mapping: linears that read the same input activations share one
per-input-channel scale ``s``. Their weight columns are multiplied by ``s`` and the operation that
produced their input, ``prev``, absorbs ``diag(s)⁻¹``: a norm divides its elements, a linear its
output rows (``rows(cfg)`` picks which rows; None: all). The scale is searched on the input of the
first linear present (every role is a role name of the family's table). Roles a layer does not
hold are left out; a balance with no linear left is skipped. Routed-expert linears expand to every
expert, each scored on the tokens routed to it. ``compensate``: a role that reads the same input
but is not quantized (the router): its columns are multiplied by ``s`` so that its output stays.
``when(cfg)``: False skips the balance for that config (Qwen3-MoE's v → o under GQA).

Per decoder layer the calibration runs, in order: ``balances``; the clip search of the ``clips``
linears on their own inputs; ``mlp_input``; then every gated MLP of the role table
(``ModelFamily.mlps``): its up → down balance and the clips of its gate, up and down.
``clip_skip`` names the module leaves AutoAWQ never clips (the default of
``AwqOptions.clip_skip``; AutoAWQ skips the query/key projections).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AwqMappings", "Balance"]


@dataclass(frozen=True)
class Balance:
    """One AWQ mapping (module docstring)."""

    label: str  # its name in the calibration statistics
    prev: str
    linears: tuple[str, ...]
    rows: Callable[[Any], Any] | None = None  # cfg → int64 row indices of ``prev`` (a linear)
    compensate: str | None = None
    option: str | None = None  # the ``AwqOptions`` flag that turns it on (None: always on)
    when: Callable[[Any], bool] | None = None  # cfg → whether the shapes allow it (None: always)


@dataclass(frozen=True)
class AwqMappings:
    """What a layer's AWQ calibration balances and clips (module docstring)."""

    balances: tuple[Balance, ...]
    clips: tuple[str, ...]
    mlp_input: Balance | None
    clip_skip: tuple[str, ...] = ()
