"""Fused 3-D routed-expert sources, read expert by expert as per-expert linears.

Some MoE checkpoints store a layer's routed experts as two 3-D tensors under the stacked expert
module (``mlp.experts``) instead of one ``[out, in]`` linear per expert:

* **transposed** (the released Qwen3-VL-MoE BF16 checkpoints): ``gate_up_proj [E, H, 2I]``,
  ``down_proj [E, I, H]`` — ``x @ W`` orientation; gate is the first half of the last dim.
  transformers transposes them at load (``conversion_mapping.py:1450-1461``, ``Transpose(1, 2,
  check_dims=True)``) to the module's ``[E, 2I, H]`` / ``[E, H, I]``
  (``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py:122-123``); vLLM reads them with
  ``is_fused_checkpoint_transposed=True`` (``vllm/model_executor/models/qwen3_vl_moe.py:76``).
* **linear** (nn.Linear orientation): ``gate_up_proj [E, 2I, H]`` (gate the first I rows),
  ``down_proj [E, H, I]`` — what transformers 5.24's ``save_pretrained`` writes for
  Qwen3-VL-MoE (it saves the module's layout; measured: ``tests/formats/test_fused_experts.py``)
  and transformers' in-memory layout of every fused MoE (``conversion_mapping.py:1386-1398``).
  ``Qwen3MoeForCausalLM.save_pretrained`` reverts to per-expert tensors (measured, same test).

A family declares the layout it expects (:class:`FusedExperts`); which one a tensor is follows
from its shape, the declared one where the shape cannot tell (``H == 2I`` or ``H == I``); a shape
that is neither is refused, naming the tensor and the config's shapes. Only float tensors
(BF16 / F16 / F32): no released checkpoint stores fused FP8 experts (the Qwen3-VL ``-FP8``
repos store them per expert with 128×128 block scales), so a fused FP8 tensor is refused.

Reading one expert never maps the 3-D tensor: the source's tensors are header entries (byte
ranges of a memory-mapped file). :func:`unfuse` replaces each fused entry by ``E`` per-expert
:class:`ExpertSlice` entries named as the family's per-expert roles
(``mlp.experts.{e}.gate_proj.weight`` ...). Expert ``e``'s block is the contiguous byte range
``[start + e·b, start + (e+1)·b)`` of ``b = 2I·H·itemsize`` bytes (``I·H`` for down), seen as its
stored 2-D ``[H, 2I]``; the gate's ``[I, H]`` is that block's column half ``[:, :I]`` transposed —
a strided view (row ``i`` of the linear is column ``i`` of the block: stride ``2I`` elements),
which ``ExpertSlice.pick`` copies into one contiguous ``[I, H]`` matrix: one expert's linear in
memory at a time, the bytes rearranged, never converted (bit-exact).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import itemsize
from .errors import HetquantError
from .safetensors_io import HeaderEntry

__all__ = ["FUSED_DTYPES", "ExpertSlice", "FusedExperts", "unfuse"]

FUSED_DTYPES = frozenset({"BF16", "F16", "F32"})
Entries = dict[str, tuple[str, HeaderEntry]]  # tensor name → (shard file, header entry)


@dataclass(frozen=True)
class FusedExperts:
    """A family's fused-expert source layout: the leaves under its stacked expert module and the
    orientation it declares (module docstring)."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    transposed: bool = True  # [E, H, 2I] / [E, I, H]; False: [E, 2I, H] / [E, H, I]


@dataclass(frozen=True)
class ExpertSlice(HeaderEntry):
    """One expert's linear inside a fused tensor: ``start``/``end`` its contiguous block
    (``block`` shape as stored), ``shape`` the linear's ``[out, in]``, ``part`` the half of a
    gate_up block it takes (0 gate, 1 up; None: the whole block, a down_proj)."""

    block: tuple[int, int] = (0, 0)
    part: int | None = None
    transposed: bool = True

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.block

    def pick(self, block: np.ndarray) -> np.ndarray:
        """The linear ``[out, in]`` from the expert's stored ``block``, one contiguous copy."""
        if self.part is not None:
            n = self.block[1 if self.transposed else 0] // 2
            half = slice(self.part * n, (self.part + 1) * n)
            block = block[:, half] if self.transposed else block[half, :]
        return np.ascontiguousarray(block.T if self.transposed else block)


def unfuse(cfg: Any, entries: Entries) -> Entries:
    """``entries`` with every fused tensor of ``cfg``'s family replaced by its per-expert
    :class:`ExpertSlice` entries (the family declares none: ``entries`` unchanged)."""
    family = cfg.family
    layout: FusedExperts | None = family.fused_experts
    if layout is None:
        return entries
    fused: dict[int, dict[str, tuple[str, str, HeaderEntry]]] = {}
    out: Entries = {}
    for name, (file, entry) in entries.items():
        module, _, leaf = name.rpartition(".")
        hit = family.locate(module) if leaf in (layout.gate_up, layout.down) else None
        if hit is None or hit.role is not None or hit.layer is None:
            out[name] = (file, entry)
            continue
        fused.setdefault(hit.layer, {})[leaf] = (name, file, entry)
    for layer, parts in fused.items():
        out.update(_layer(cfg, layout, layer, parts))
    return out


def _layer(
    cfg: Any, layout: FusedExperts, layer: int, parts: Mapping[str, tuple[str, str, HeaderEntry]]
) -> Entries:
    family, mlp = cfg.family, cfg.family.mlp("routed")
    first = next(iter(parts.values()))[0]
    if not cfg.is_moe_layer(layer):
        raise HetquantError(
            f"{first}: fused experts in layer {layer}, which config.json makes dense"
        )
    if set(parts) != {layout.gate_up, layout.down}:
        lacks = ({layout.gate_up, layout.down} - set(parts)).pop()
        raise HetquantError(
            f"{first}: its layer's fused {lacks} is missing; the checkpoint is incomplete"
        )
    e = cfg.num_experts
    inter, hidden = family.role(mlp.gate).shape(cfg)  # [I, H]
    shapes = {  # leaf → (transposed, linear) stored shapes
        layout.gate_up: ((e, hidden, 2 * inter), (e, 2 * inter, hidden)),
        layout.down: ((e, inter, hidden), (e, hidden, inter)),
    }
    transposed = _orientation(layout, parts, shapes)
    out: Entries = {}
    for leaf, (name, file, entry) in parts.items():
        want = shapes[leaf][0 if transposed else 1]
        if entry.shape != want:
            t, lin = shapes[leaf]
            raise HetquantError(
                f"{name}: shape {list(entry.shape)} disagrees with config.json, which implies "
                f"{list(t)} (x @ W, as released) or {list(lin)} (nn.Linear) for {e} experts, "
                f"hidden {hidden}, moe_intermediate {inter}; use the config.json of this checkpoint"
            )
        if entry.dtype not in FUSED_DTYPES:
            raise HetquantError(
                f"{name}: fused {entry.dtype} experts are not read (no released checkpoint stores "
                "fused quantized experts); hetquant reads fused BF16 / F16 / F32, or per-expert "
                "FP8 with its scales"
            )
        block = want[1:]
        size = math.prod(block) * itemsize(entry.dtype)
        roles = (mlp.gate, mlp.up) if leaf == layout.gate_up else (mlp.down,)
        for x in range(e):
            start = entry.start + x * size
            for k, role in enumerate(roles):
                target = family.tensor(role, layer, x)
                shape = family.role(role).shape(cfg)
                part = k if leaf == layout.gate_up else None
                out[target] = (file, ExpertSlice(target, entry.dtype, shape, start, start + size,
                                                 block, part, transposed))  # fmt: skip
    return out


def _orientation(
    layout: FusedExperts,
    parts: Mapping[str, tuple[str, str, HeaderEntry]],
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
) -> bool:
    """Whether the layer's pair is stored transposed: the first tensor whose shape tells, else the
    layout's declared orientation (both shapes alike, or neither: refused by the caller)."""
    for leaf in (layout.down, layout.gate_up):
        t, lin = shapes[leaf]
        got = parts[leaf][2].shape
        if t != lin and got in (t, lin):
            return got == t
    return layout.transposed
