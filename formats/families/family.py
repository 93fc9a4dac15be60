"""A registered model family: its config type, role table and AWQ mappings, and what they
answer — tensor names by role, the tensors a checkpoint of a config holds, and which role a
stored module name is (``base.py`` says what a family declares and holds the registry).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from ..errors import HetquantError
from ..fused_experts import FusedExperts
from .mappings import AwqMappings
from .roles import GLOBAL, GLOBAL_LAST, MTP, GatedMlp, Located, Role, TensorRole

__all__ = ["ModelFamily", "TableConfig", "bound"]


class TableConfig(Protocol):
    """What expanding a role table reads of a config (``base.ModelConfig`` provides it; the
    family is defined before, and without, the config type's registry)."""

    num_experts: int

    @property
    def total_layers(self) -> int: ...

    @property
    def mtp_layer_ids(self) -> range: ...

    def is_moe_layer(self, layer: int) -> bool: ...

    def layer_scopes(self, layer: int) -> frozenset[str]: ...


@dataclass(frozen=True, eq=False)
class ModelFamily:
    """A registered family: its config type, role table and AWQ mappings (module docstring).

    Compared and hashed by identity: a registered family is one object (its name is unique in the
    registry), and ``bound``'s cache hashes it once per config lookup — field hashing walked the
    whole role table on every ``ModelConfig.family`` (0.28 s of a 256-expert plan).
    """

    name: str
    config_type: type[Any]  # a ``base.ModelConfig`` subclass
    roles: tuple[Role, ...]
    awq: AwqMappings
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    layer_prefix: str = "model.layers.{layer}."
    attention_group: str = "attention"  # the precision group attention data parallel replicates
    # why hetquant's reference forward cannot run the family ("": it can); run / eval refuse it
    forward_refusal: str = ""

    # model types that resemble the family but are refused: (model_type, why)
    refused_types: tuple[tuple[str, str], ...] = ()
    # stored tensor names (regex, searched) a source of the family is refused for: (regex, why)
    refused: tuple[tuple[str, str], ...] = ()
    # the fused 3-D routed-expert layout its sources may store (None: per-expert only)
    fused_experts: FusedExperts | None = None
    # the MTP layers' own prefix (``mtp.{mtp}.``: DeepSeek-V4 names MTP layer n + m ``mtp.m.``;
    # None: they take ``layer_prefix``), and the first MTP layer id, set by ``ModelConfig.family``
    mtp_prefix: str | None = None
    first_mtp: int | None = None
    # which config.json of ``model_types`` this family reads (None: every one); several families
    # of one model type tell their on-disk layouts apart by it
    accepts: Callable[[Mapping[str, Any]], bool] | None = None

    def prefix(self, layer: int) -> str:
        """The tensor name prefix of decoder layer ``layer`` (MTP ones under ``mtp_prefix``)."""
        if self.mtp_prefix is not None and self.first_mtp is not None and layer >= self.first_mtp:
            return self.mtp_prefix.format(mtp=layer - self.first_mtp)
        return self.layer_prefix.format(layer=layer)

    def refusal(self, name: str) -> str | None:
        """Why a stored tensor ``name`` no role takes is refused by name (None: not known)."""
        return next((why for pat, why in self.refused if re.search(pat, name)), None)

    def parse_config(self, raw: dict[str, Any], origin: str = "config.json") -> Any:
        """``raw`` parsed by ``config_type`` (a ``base.ModelConfig``)."""
        return self.config_type.parse(raw, origin)

    @cached_property
    def _by_name(self) -> dict[str, Role]:
        return {r.name: r for r in self.roles}

    def role(self, name: str) -> Role:
        return self._by_name[name]

    def tensor(self, role: str, layer: int | None = None, expert: int | None = None) -> str:
        """The tensor name of ``role`` (in ``layer``, for routed ``expert``)."""
        r = self._by_name[role]
        if r.scope in (GLOBAL, GLOBAL_LAST):
            return r.pattern
        return self.prefix(layer) + r.pattern.format(e=expert)

    def module(self, role: str, layer: int | None = None, expert: int | None = None) -> str:
        """The module name of ``role`` (its tensor name without the local key)."""
        return self.tensor(role, layer, expert).rpartition(".")[0]

    @cached_property
    def mlps(self) -> tuple[GatedMlp, ...]:
        """The gated MLPs of the table (by expert kind, in table order)."""
        parts: dict[str | None, dict[str, str]] = {}
        for r in self.roles:
            if r.mlp is not None:
                parts.setdefault(r.expert, {})[r.mlp] = r.name
        return tuple(GatedMlp(kind, p["gate"], p["up"], p["down"]) for kind, p in parts.items())

    def mlp(self, expert: str | None) -> GatedMlp | None:
        """The gated MLP of expert kind ``expert`` (None: the dense MLP), if the table has one."""
        return next((m for m in self.mlps if m.expert == expert), None)

    def mlp_modules(self, expert: str | None, layer: int, e: int | None = None) -> tuple[str, ...]:
        """(gate, up, down) module names of that MLP in ``layer`` (routed expert ``e``)."""
        m = self.mlp(expert)
        if m is None:
            raise HetquantError(f"model family {self.name} has no {expert or 'dense'} MLP")
        return tuple(self.module(r, layer, e) for r in (m.gate, m.up, m.down))

    def stacked_experts(self, layer: int) -> str | None:
        """The module under which an expert-layer format stacks ``layer``'s routed experts
        (the routed experts' module up to the expert index); None without routed experts."""
        return None if self._stacked is None else self.prefix(layer) + self._stacked

    def layer_roles(self, cfg: TableConfig, layer: int) -> tuple[Role, ...]:
        """The roles decoder layer ``layer`` holds, in table order."""
        scopes = cfg.layer_scopes(layer) | ({MTP} if layer in cfg.mtp_layer_ids else set())
        return tuple(r for r in self.roles if r.scope in scopes)

    def expected_tensors(self, cfg: TableConfig) -> dict[str, TensorRole]:
        """Every tensor name a checkpoint of ``cfg`` must hold (scales excluded), in model order:
        ``global`` roles, the decoder layers (MTP last), ``global_last`` roles."""
        out = {r.pattern: TensorRole(r, None, None, r.shape(cfg)) for r in self.roles
               if r.scope == GLOBAL}  # fmt: skip
        for layer in range(cfg.total_layers):
            mtp = layer in cfg.mtp_layer_ids
            stack = self.stacked_experts(layer) if cfg.is_moe_layer(layer) else None
            for r in self.layer_roles(cfg, layer):
                routed = r.expert == "routed"
                for e in range(cfg.num_experts) if routed else (None,):
                    name = self.tensor(r.name, layer, e)
                    out[name] = TensorRole(
                        r, layer, e, r.shape(cfg), mtp, stack if routed else None
                    )
        out.update({r.pattern: TensorRole(r, None, None, r.shape(cfg)) for r in self.roles
                    if r.scope == GLOBAL_LAST})  # fmt: skip
        return out

    @cached_property
    def _matchers(self) -> tuple[re.Pattern[str], dict[str, Role], list[tuple[re.Pattern, Role]]]:
        """(layer prefix regex, module → role without an expert index (global ones under their
        full name, layer ones relative to the prefix), [(regex, role)] of the expert roles)."""
        layer = _prefix_regex(self.layer_prefix, "layer")
        exact: dict[str, Role] = {}
        experts = []
        for r in self.roles:
            if "{e}" in r.module:
                pattern = r"(\d+)".join(map(re.escape, r.module.split("{e}")))
                experts.append((re.compile(pattern), r))
            else:
                key = r.module if r.scope in (GLOBAL, GLOBAL_LAST) else "." + r.module
                exact.setdefault(key, r)  # the first row of a module (router before its bias)
        return layer, exact, experts

    @cached_property
    def _stacked(self) -> str | None:
        m = self.mlp("routed")
        return None if m is None else self.role(m.gate).module.split(".{e}")[0]

    def _layer_of(self, module: str) -> tuple[int, str] | None:
        """(layer id, rest of the name) of a layer's module; None: not a layer's. A tensor
        directly under the layer (DeepSeek-V4's ``layers.3.hc_attn_fn``) has the layer itself as
        its module (``layers.3``) and an empty rest."""
        mtp = self.mtp_prefix is not None and self.first_mtp is not None
        for name in (module, module + "."):
            if (m := self._matchers[0].fullmatch(name)) is not None:
                return int(m.group(1)), m.group(2)
            if mtp and (m := _prefix_regex(self.mtp_prefix, "mtp").fullmatch(name)) is not None:
                return self.first_mtp + int(m.group(1)), m.group(2)  # type: ignore[operator]
        return None

    def locate(self, module: str) -> Located | None:
        """What module ``module`` (a tensor name without its local key) is; None: not ours."""
        _, exact, experts = self._matchers
        if (hit := self._layer_of(module)) is None:
            r = exact.get(module)
            return None if r is None else Located(r, None, None)
        layer, rest = hit
        if (r := exact.get("." + rest)) is not None:
            return Located(r, layer, None)
        if rest == self._stacked:
            return Located(None, layer, None)
        for pattern, r in experts:
            if hit := pattern.fullmatch(rest):
                return Located(r, layer, int(hit.group(1)))
        return None


@functools.cache
def _prefix_regex(prefix: str, field: str) -> re.Pattern[str]:
    """``layers.{layer}.`` → ``layers\\.(\\d+)\\.(.+)``."""
    return re.compile(re.escape(prefix).replace(r"\{" + field + r"\}", r"(\d+)") + "(.*)")


@functools.cache
def bound(family: ModelFamily, first_mtp: int) -> ModelFamily:
    """``family`` knowing its first MTP layer id (itself when its MTP layers take its layer prefix)."""
    if family.mtp_prefix is None:
        return family
    return dataclasses.replace(family, first_mtp=first_mtp)
