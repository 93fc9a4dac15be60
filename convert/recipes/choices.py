"""A rule recipe's choices: rules that are not one format (``KEEP``, ``CPU_INT4``, ``FP4``), which
the recipe's options or the source resolve to (format, params) per tensor (``quantized.py``'s
module docstring says which rule takes which)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetquant.formats import EXPERT_FORMATS, FORMATS, HetquantError
from hetquant.formats.expert_repack import repack_target
from hetquant.formats.families import TensorRole

from .base import Written

if TYPE_CHECKING:
    from .quantized import RuleRecipe

__all__ = ["CPU_INT4", "FP4", "KEEP", "Choice", "Params", "Rule"]

Params = tuple[tuple[str, Any], ...]


class Choice:
    """A rule that is not one format: the recipe's options or the source decide (module
    docstring). ``resolve`` gives (format, params), or None: keep at source precision."""

    def resolve(
        self, recipe: RuleRecipe, role: TensorRole, source_fmt: str
    ) -> tuple[Written, Params] | None:
        raise NotImplementedError


@dataclass(frozen=True)
class _Keep(Choice):
    """At source precision (``recipes.keep``)."""

    def resolve(self, recipe: RuleRecipe, role: TensorRole, source_fmt: str) -> None:
        return None


@dataclass(frozen=True)
class _ByOption(Choice):
    """The format that the value of option ``option`` names."""

    option: str
    formats: tuple[tuple[Any, Written], ...]

    def resolve(
        self, recipe: RuleRecipe, role: TensorRole, source_fmt: str
    ) -> tuple[Written, Params]:
        return dict(self.formats)[recipe.option(self.option)], ()


@dataclass(frozen=True)
class _CpuInt4(Choice):
    """``int4_cpu*`` (module docstring): the source's lossless CPU repack, else per-channel, or
    group-wise with ``cpu_group_size``."""

    def resolve(
        self, recipe: RuleRecipe, role: TensorRole, source_fmt: str
    ) -> tuple[Written, Params]:
        repack, group = repack_target(source_fmt), recipe.cpu_group_size()
        if repack is None:
            if group is None:
                return EXPERT_FORMATS["int4_cpu_experts"], ()
            return EXPERT_FORMATS["int4_cpu_group_experts"], (("group_size", group),)
        if group is not None:
            raise HetquantError(
                f"{role.role.name} (layer {role.layer}): the source stores the routed experts in "
                f"{source_fmt} (INT4 with its own groups), repacked losslessly into {repack} as "
                "they are; --cpu-group-size would re-quantize them: drop it"
            )
        return EXPERT_FORMATS[repack], ()  # the source's group: ``refine``


KEEP: Choice = _Keep()
CPU_INT4: Choice = _CpuInt4()
FP4: Choice = _ByOption(
    "fp4_layout", (("ascend", FORMATS["nvfp4_ascend"]), ("nvfp4", FORMATS["nvfp4"]))
)
Rule = Written | Choice  # a rule table's value
