"""A test recipe that proves the writer seam: ``ascend-hybrid`` with its routed experts written as
headerless ``raw`` blobs (``raw_experts/layer_NNN.bin``) instead of safetensors files.

Importable by worker processes (spawned workers get the parent's ``sys.path``); not registered on
import, so the session's recipe list stays the real one: ``register()`` adds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetquant.convert import RECIPES, Recipe, Target, get_recipe
from hetquant.convert.recipes import Written
from hetquant.convert.recipes.quantized import Params, RuleRecipe
from hetquant.formats.families import TensorRole

NAME = "test-hybrid-raw-experts"
PART = "raw_experts"


@dataclass(frozen=True)
class RawExperts(RuleRecipe):
    def _target(self, fmt: Written, params: Params, role: TensorRole) -> Target:
        if fmt.name == "int4_cpu_experts":
            file = f"{PART}/layer_{role.layer:03d}.bin"
            return Target.writing(fmt, params, part=PART, file=file, container="raw")
        return super()._target(fmt, params, role)


def recipe() -> Recipe:
    hybrid = get_recipe("ascend-hybrid")
    return RawExperts(**{f.name: getattr(hybrid, f.name) for f in dataclasses.fields(hybrid)} | {"name": NAME})  # fmt: skip


def register() -> Recipe:
    RECIPES[NAME] = recipe()
    return RECIPES[NAME]
