"""Formats as objects: a Target's action and format object, Job.kind an enum, the expert-layer
formats' declared row-streaming capability."""

from __future__ import annotations

import pytest
from support import TINY

from hetquant.convert import RECIPES, SourceCheckpoint, Target, plan_for
from hetquant.convert.planning.plan import JobKind
from hetquant.convert.recipes import COPY, DROP, Action
from hetquant.formats import (
    EXPERT_FORMATS,
    ExpertLayerFormat,
    HetquantError,
    WeightFormat,
    get_format,
)


def test_target_action_and_format() -> None:
    assert Target(COPY).action is Action.COPY and Target(DROP).action is Action.DROP
    for t in (Target(COPY), Target(DROP)):
        with pytest.raises(HetquantError, match="writes no format"):
            t.format()
    linear = Target("awq_w4a16", params=(("group_size", 64),))
    assert linear.action is Action.CONVERT
    assert linear.format() == get_format("awq_w4a16", group_size=64)
    experts = Target("int4_cpu_group_experts", part="cpu_experts", params=(("group_size", 32),))
    fmt = experts.format()
    assert isinstance(fmt, ExpertLayerFormat) and fmt.group_size == 32
    with pytest.raises(HetquantError, match="unknown format 'nope'"):
        Target("nope").format()


def test_streams_rows_is_declared_where_quantize_rows_is() -> None:
    for name, fmt in EXPERT_FORMATS.items():
        assert fmt.streams_rows == callable(getattr(fmt, "quantize_rows", None)), name


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_job_has_a_kind_and_its_target_a_format(recipe: str) -> None:
    plan = plan_for(SourceCheckpoint.open(TINY), RECIPES[recipe], 1 << 20)
    for job in plan.jobs:
        assert isinstance(job.kind, JobKind)
        if job.kind is JobKind.COPY:
            assert job.target.action is Action.COPY
            continue
        fmt = job.target.format()
        assert fmt.name == job.target.fmt
        assert isinstance(fmt, ExpertLayerFormat if job.kind is JobKind.EXPERTS else WeightFormat)
