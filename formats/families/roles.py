"""The rows of a family's role table and what they expand to (``base.py`` says how a family uses
them).

Scopes every family shares: ``global`` (before the decoder layers), ``global_last`` (after them),
``mtp`` (the multi-token-prediction layers only); a family names its other scopes
(``ModelConfig.layer_scopes``). ``tp``: ``column`` splits dim 0 of a weight [out, in], ``row``
dim 1, ``vocab`` dim 0 of an embedding or head (padded: ⌈V/tp⌉ rows per rank), ``replicate``
none.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import Shape

__all__ = [
    "EXPERT_KINDS",
    "GLOBAL",
    "GLOBAL_LAST",
    "KINDS",
    "MTP",
    "SCALE_SUFFIX",
    "TP_SPLITS",
    "GatedMlp",
    "Located",
    "Role",
    "TensorRole",
]

GLOBAL, GLOBAL_LAST, MTP = "global", "global_last", "mtp"  # scopes every family shares
TP_SPLITS = ("column", "row", "replicate", "vocab")
# "index": an integer table (DeepSeek-V4's token → expert hash routing)
KINDS = ("linear", "norm", "embedding", "head", "router", "bias", "index")
EXPERT_KINDS = (None, "shared", "routed")
SCALE_SUFFIX = "_scale_inv"  # an FP8 block weight's scale partner: ``<weight name>_scale_inv``


@dataclass(frozen=True)
class Role:
    """One row of a role table.

    ``pattern``: the tensor name, global or relative to the family's ``layer_prefix``; ``{e}``
    stands for the routed expert index. ``scope``: which layers hold it (module docstring);
    ``tp``: how tensor parallelism splits it (module docstring). ``mlp``: its part of a gated MLP
    ``down(silu(gate(x)) · up(x))``. ``absorbed``: a linear that engines fold into attention
    (MLA's ``kv_b_proj``: vllm-ascend keeps it unquantized). ``fuse``: the module engines merge
    this linear into with the others of its layer (and expert) that name the same one — linears
    reading one input, run as one GEMM (vLLM's packed modules: ``fused_qkv_a_proj``,
    ``qkv_proj``); a gated MLP's gate and up are always merged (:attr:`fused`).
    """

    name: str
    pattern: str
    scope: str
    group: str  # precision-table group
    kind: str  # KINDS
    tp: str  # TP_SPLITS
    expert: str | None  # EXPERT_KINDS
    shape: Shape  # of the family's config: data (``shapes.py``), so plans pickle
    mlp: str | None = None  # gate | up | down
    absorbed: bool = False
    kept: bool = False
    fuse: str | None = None

    @property
    def fused(self) -> str | None:
        """The merged module this linear belongs to (None: run alone): ``fuse``, or
        ``gate_up_proj`` for a gated MLP's gate and up (vLLM ``MergedColumnParallelLinear`` /
        a routed expert's ``w13``)."""
        return self.fuse or ("gate_up_proj" if self.mlp in ("gate", "up") else None)

    @property
    def module(self) -> str:
        """The pattern without its local key (``self_attn.q_a_proj``)."""
        return self.pattern.rpartition(".")[0]


@dataclass(frozen=True)
class TensorRole:
    """A concrete tensor: its role, layer (None: global), routed expert index and shape."""

    role: Role
    layer: int | None
    expert: int | None
    shape: tuple[int, ...]
    mtp: bool = False  # belongs to a multi-token-prediction layer
    stack: str | None = None  # routed experts: the module their stacked tensors take


@dataclass(frozen=True)
class GatedMlp:
    """The three roles of one gated MLP (``expert``: None dense, or its expert kind)."""

    expert: str | None
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class Located:
    """What a module name is: its role (None: the stacked routed experts of a layer), layer and
    routed expert index."""

    role: Role | None
    layer: int | None
    expert: int | None
