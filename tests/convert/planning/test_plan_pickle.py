"""A plan is data: it pickles whole (role shapes are expressions, targets carry format objects),
so spawned workers receive the parent's plan instead of rebuilding it from the source."""

from __future__ import annotations

import inspect
import pickle

import pytest
from support import TINY

from hetquant.convert import SourceCheckpoint, get_recipe, plan_for
from hetquant.convert.engine import workers
from hetquant.convert.recipes import RECIPES


@pytest.fixture(scope="module")
def tiny_source() -> SourceCheckpoint:
    return SourceCheckpoint.open(TINY)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_plan_pickles_to_an_equal_plan(tiny_source: SourceCheckpoint, recipe: str) -> None:
    plan = plan_for(tiny_source, get_recipe(recipe), 1 << 20)
    back = pickle.loads(pickle.dumps(plan))
    assert back.recipe == plan.recipe and back.max_shard_size == plan.max_shard_size
    assert back.items == plan.items and back.jobs == plan.jobs
    assert [(f.name, f.layout_digest()) for f in back.files] == [
        (f.name, f.layout_digest()) for f in plan.files
    ]
    assert back.digest("fp") == plan.digest("fp")


def test_spawned_workers_take_the_plan_and_do_not_rebuild_it() -> None:
    assert "plan" in inspect.signature(workers.init_spawned).parameters
    assert not hasattr(workers, "plan_for")
