"""A compressed-tensors ``quantization_config`` read as a source's: which scheme covers which
module, and whether hetquant reads it.

config.json of a compressed-tensors checkpoint (Kimi-K2-Thinking's, llm-compressor's W4A16)::

    {"quant_method": "compressed-tensors", "format": "pack-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                   "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                                               "strategy": "group", "group_size": 32,
                                               "actorder": null, "dynamic": false, ...},
                                   "input_activations": null, "output_activations": null}},
     "ignore": ["lm_head", "re:.*self_attn.*", ...]}

Matching follows compressed-tensors ``utils/match.py`` (``is_match`` / ``match_name``, 0.20.0): a
target or ignore entry matches a module when it equals the module's name, when it starts with
``re:`` and the rest ``re.match``-es the name (anchored at the start only), or when it names a
class of the module — here ``Linear``, which DeepSeek's modeling code uses for every linear and
``lm_head`` (the router ``mlp.gate`` is its own ``MoEGate`` class, embeddings ``nn.Embedding``).
A module a group's targets match and no ignore entry matches takes that group's scheme. Other
class names (vllm-ascend's tutorial edits K2-Thinking's targets to ``["MoE"]``) match no module by
name; a module stored pack-quantized that no group matches then takes the only group when there is
one.

What is read (:meth:`CtScheme.refusal` says why anything else is not): ``format`` (the group's,
else the top level's) ``pack-quantized``; weights ``num_bits`` 4, ``type`` int, ``symmetric``
true, ``strategy`` group with a ``group_size`` that divides the module's input features,
``actorder`` null / false / ``weight`` / ``static`` (compressed-tensors
``quant_args.py`` ``ActivationOrdering``: ``weight`` reorders columns during calibration only and
"doesn't change the quantization format"; ``static`` is its alias), never ``group`` / ``dynamic``
/ true (a ``weight_g_idx`` permutation on disk, which hetquant does not read),
``dynamic`` false; no input or output
activation quantization (W4A16). ``weight_zero_point`` / ``weight_g_idx`` tensors in the
checkpoint are refused whatever the config says.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import HetquantError
from .families.fields import ConfigFields

__all__ = ["CT_METHOD", "UNREAD_KEYS", "CtQuantConfig", "CtScheme"]

CT_METHOD = "compressed-tensors"
READ_FORMAT = "pack-quantized"
CLASS_KINDS = {"Linear": ("linear", "head")}  # class target → role kinds of that class
FORMAT_NEUTRAL_ACTORDER = (None, False, "weight", "static")
UNREAD_KEYS = {
    "weight_zero_point": "zero points (asymmetric quantization)",
    "weight_g_idx": "activation ordering (weight_g_idx)",
}


@dataclass(frozen=True)
class CtScheme:
    """One config group: its name, targets, weight arguments, activations and format."""

    name: str
    targets: tuple[str, ...]
    weights: Mapping[str, Any]
    activations: bool  # input or output activations quantized
    format: str

    def describe(self) -> str:
        w = self.weights
        parts = [f"format {self.format}", f"{w.get('type', 'int')}{w.get('num_bits')}"]
        parts += [f"strategy {w.get('strategy')}", f"group_size {w.get('group_size')}"]
        parts += [f"symmetric {w.get('symmetric', True)}", f"actorder {w.get('actorder')}"]
        if self.activations:
            parts.append("activations quantized")
        return f"compressed-tensors {self.name} ({', '.join(parts)})"

    @property
    def group_size(self) -> int | None:
        g = self.weights.get("group_size")
        return g if isinstance(g, int) and not isinstance(g, bool) else None

    def refusal(self, in_features: int) -> str | None:
        """Why hetquant does not read this scheme for a weight with ``in_features`` inputs."""
        w = self.weights
        if self.format != READ_FORMAT:
            return f"format {self.format!r} is not read (only {READ_FORMAT!r})"
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            return f"{w.get('type')}{w.get('num_bits')} weights are not read (only int4)"
        if w.get("symmetric", True) is not True:
            return "asymmetric weights (zero points) are not read"
        if w.get("actorder") not in FORMAT_NEUTRAL_ACTORDER:
            return f"activation ordering (actorder {w.get('actorder')!r}) is not read"
        if w.get("strategy") != "group" or self.group_size is None or self.group_size <= 0:
            return f"strategy {w.get('strategy')!r} is not read (only group)"
        if in_features % self.group_size:
            return f"group_size {self.group_size} does not divide the {in_features} input features"
        if w.get("dynamic", False) is not False:
            return "dynamic weight quantization is not read"
        if self.activations:
            return "activation quantization is not read (only W4A16)"
        return None


@dataclass(frozen=True)
class CtQuantConfig:
    """config.json's compressed-tensors ``quantization_config``: its groups and ignore list."""

    schemes: tuple[CtScheme, ...]
    ignore: tuple[str, ...]

    @classmethod
    def parse(cls, qc: Mapping[str, Any], origin: str = "config.json") -> CtQuantConfig:
        groups = qc.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise HetquantError(
                f"{origin}: compressed-tensors quantization_config has no config_groups"
            )
        f = ConfigFields(qc, origin, "quantization_config.")
        top = f.text("format", "dense")
        schemes = []
        for name, g in groups.items():
            if not isinstance(g, Mapping) or not isinstance(g.get("weights"), Mapping):
                raise HetquantError(
                    f"{origin}: compressed-tensors config group {name!r} has no weights arguments"
                )
            group = f.mapping("config_groups").mapping(name)
            acts = any(g.get(k) for k in ("input_activations", "output_activations"))
            targets = _patterns(group, "targets")
            schemes.append(CtScheme(name, targets, g["weights"], acts, group.text("format", top)))
        return cls(tuple(schemes), _patterns(f, "ignore"))

    def scheme_for(self, module: str, kind: str, stored_quantized: bool) -> CtScheme | None:
        """The scheme covering ``module`` (a role of ``kind``), None: not quantized by config."""
        if _matches(module, kind, self.ignore):
            return None
        hit = next((s for s in self.schemes if _matches(module, kind, s.targets)), None)
        if hit is None and stored_quantized and len(self.schemes) == 1:
            return self.schemes[0]
        return hit

    def check(self, module: str, kind: str, shape: tuple[int, ...], keys: Iterable[str]) -> None:
        """Refuse ``module`` (stored tensors ``keys``) if its scheme or tensors are not read."""
        keys = set(keys)
        for key, what in UNREAD_KEYS.items():
            if key in keys:
                raise HetquantError(
                    f"{module}.{key}: the checkpoint stores {what}, which hetquant does not read"
                    " (symmetric group-wise pack-quantized INT4 only)"
                )
        scheme = self.scheme_for(module, kind, "weight_packed" in keys)
        if scheme is None:
            return
        why = scheme.refusal(shape[-1])
        if why is not None:
            raise HetquantError(
                f"{module}: quantization_config gives it {scheme.describe()}: {why}; hetquant "
                "reads symmetric group-wise pack-quantized INT4 (W4A16)"
            )


def _patterns(f: ConfigFields, key: str) -> tuple[str, ...]:
    """A targets / ignore list: strings, each ``re:`` one a valid regular expression."""
    entries = f.texts(key, ())
    for entry in (e for e in entries if e.startswith("re:")):
        try:
            re.compile(entry[3:])
        except re.error as e:
            raise f.fail(key, entry, f"a valid regular expression after 're:' ({e})") from None
    return entries


def _matches(module: str, kind: str, entries: Iterable[str]) -> bool:
    for entry in entries:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif entry == module or kind in CLASS_KINDS.get(entry, ()):
            return True
    return False
