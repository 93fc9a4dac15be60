"""Role classes: what a recipe's rules are keyed by, from the attributes of a tensor's role in
its family's table.

``mtp_extra`` (a role only MTP layers hold: DeepSeek's enorm/hnorm/eh_proj/embed_tokens/
shared_head), ``kept`` (a role every recipe keeps: DeepSeek-V3.2's indexer), ``routed`` /
``shared`` (routed / shared expert MLPs), ``router`` (router weight and bias), ``embedding``
(embeddings and heads), ``norm``, ``dense`` (a dense-layer MLP), ``absorbed`` (a linear engines
fold into attention: DeepSeek's kv_b_proj), ``vision`` (a vision-language model's vision linear
that engines read quantized: ``formats/families/vlm.py``; every other vision tensor is ``kept``)
and ``attention`` (every other linear: q_a/q_b/q/kv_a/o).
"""

from __future__ import annotations

import functools

from hetquant.formats.families import TensorRole
from hetquant.formats.families.roles import MTP
from hetquant.formats.families.vlm import VISION

__all__ = ["dense_down", "role_class"]

_CLASS_OF_KIND = {"router": "router", "bias": "router", "embedding": "embedding",
                  "head": "embedding", "norm": "norm"}  # fmt: skip


def role_class(role: TensorRole) -> str:
    """The recipe-facing class of a tensor role (module docstring)."""
    r = role.role
    if r.kept:
        return "kept"
    if r.scope == VISION:  # a vision linear engines read quantized (formats/families/vlm.py)
        return VISION
    if r.scope == MTP:
        return "mtp_extra"
    if r.expert is not None:
        return r.expert
    if r.kind in _CLASS_OF_KIND:
        return _CLASS_OF_KIND[r.kind]
    if r.mlp is not None:
        return "dense"
    return "absorbed" if r.absorbed else "attention"


@functools.cache
def dense_down(cls: str, role: TensorRole) -> bool:
    """Whether a tensor of ``role`` in rule class ``cls`` is a dense MLP's down_proj."""
    return cls == "dense" and role.role.mlp == "down"
