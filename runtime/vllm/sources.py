"""Which stored modules a vLLM layer stands for, and in which format each is stored.

vLLM fuses some linears of the checkpoint into one layer: DeepSeek-V3's ``fused_qkv_a_proj`` is
``q_a_proj`` + ``kv_a_proj_with_mqa``, every ``gate_up_proj`` is ``gate_proj`` + ``up_proj``,
Qwen3's ``qkv_proj`` is ``q_proj`` + ``k_proj`` + ``v_proj``. The model class declares them in
``packed_modules_mapping`` (``vllm/model_executor/models/deepseek_v2.py:1880``), which vLLM copies
into the quantization config before it builds the layers (``base_config.py:125``). A fused
layer's output is its parts' outputs concatenated, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetquant.formats import HetquantError

from ..loading.loader import Artifact

__all__ = ["SOURCES", "TENSORS", "Source", "expect", "layer_sources", "shared_format", "take"]


@dataclass(frozen=True)
class Source:
    """One stored module a vLLM layer reads: its prefix and format (None: not stored)."""

    prefix: str
    fmt: str | None
    params: Mapping[str, Any]

    @property
    def stored(self) -> bool:
        return self.fmt is not None


def layer_sources(
    art: Artifact,
    prefix: str,
    packed: Mapping[str, Sequence[str]],
    stored_name: Callable[[str], str] = lambda m: m,
) -> tuple[Source, ...]:
    """The stored modules behind the vLLM layer ``prefix``, in output order; ``stored_name``
    turns a vLLM module name into the artifact's (``names.VllmNames.stored``)."""
    parent, _, name = prefix.rpartition(".")
    parts = packed.get(name) or _merged_parts(art, parent, name) or [name]
    out = []
    for part in parts:
        stored = stored_name(f"{parent}.{part}" if parent else part)
        info = art.modules.get(stored)
        fmt = info.fmt if info is not None else None
        out.append(Source(stored, fmt.name if fmt else None, fmt.params if fmt else {}))
    return tuple(out)


def _merged_parts(art: Artifact, parent: str, name: str) -> list[str]:
    """The stored modules under ``parent`` that the family's role table merges into ``name``
    (``Role.fused``), in table order. vLLM's ``packed_modules_mapping`` can lack a merged layer
    it builds: Qwen3-MoE adds its dense layers' ``gate_up_proj`` in ``__init__``
    (``qwen3_moe.py:576``), after ``SupportsQuant.__new__`` copied the mapping into the
    quantization config (``interfaces.py:1259``) — in a fresh process the first such model's
    config does not have it."""
    if name in art.modules:
        return []
    family = art.cfg.family
    order = {role.name: i for i, role in enumerate(family.roles)}
    parts = []
    for stored in art.modules:
        head, _, tail = stored.rpartition(".")
        loc = family.locate(stored) if head == parent else None
        if loc is not None and loc.role is not None and loc.role.fused == name:
            parts.append((order[loc.role.name], tail))
    return [tail for _, tail in sorted(parts)]


def shared_format(sources: Sequence[Source]) -> str | None:
    """The format name every one of ``sources`` is stored in, with the same parameters (where a
    vLLM kernel for that format may serve them all); None where they differ."""
    variants = {(s.fmt, tuple(sorted(s.params.items()))) for s in sources}
    return str(sources[0].fmt) if len(variants) == 1 else None


SOURCES = "hetquant_sources"  # layer attribute: the Sources a hetquant method reads
TENSORS = "hetquant_tensors"  # layer attribute: stored prefix → {key: tensor}, set by the loader


def expect(layer: Any, sources: Sequence[Source]) -> None:
    """Mark ``layer`` as reading ``sources`` through the hetquant loader (not vLLM's)."""
    setattr(layer, SOURCES, tuple(sources))
    setattr(layer, TENSORS, {})


def take(layer: Any, what: str) -> dict[str, dict[str, Any]]:
    """The tensors the loader gave ``layer`` (handed over once); a source it did not give fails
    naming it."""
    got: dict[str, dict[str, Any]] = getattr(layer, TENSORS, {})
    missing = [s.prefix for s in getattr(layer, SOURCES, ()) if s.prefix not in got]
    if missing:
        raise HetquantError(
            f"{what}: no weights were loaded for {', '.join(missing[:4])}"
            f"{' …' if len(missing) > 4 else ''}; load with --load-format hetquant"
        )
    setattr(layer, TENSORS, {})
    return got
