"""Formats as objects: a Target's action and format object, Job.kind an enum, rule tables of
format objects and explicit choices (the formats' declared capabilities: ``tests/formats/test_capabilities.py``)."""

from __future__ import annotations

import pickle

import pytest
from support import TINY

from hetquant.convert import RECIPES, SourceCheckpoint, Target, plan_for
from hetquant.convert.planning.plan import JobKind
from hetquant.convert.recipes import COPY_TARGET, DROP_TARGET, Action, keep
from hetquant.convert.recipes.quantized import Choice
from hetquant.formats import (
    EXPERT_FORMATS,
    FORMATS,
    ExpertLayerFormat,
    HetquantError,
    WeightFormat,
    get_format,
)


def test_target_action_and_format() -> None:
    assert COPY_TARGET.action is Action.COPY and DROP_TARGET.action is Action.DROP
    assert (COPY_TARGET.fmt, COPY_TARGET.name, DROP_TARGET.name) == (None, "copy", "drop")
    linear = Target.writing(FORMATS["awq_w4a16"], (("group_size", 64),))
    assert linear.action is Action.CONVERT and not linear.stacks_experts
    assert linear.fmt == get_format("awq_w4a16", group_size=64) and linear.name == "awq_w4a16"
    assert linear.params == (("group_size", 64),)  # what the recipe set: the plan digest's
    experts = Target.writing(
        EXPERT_FORMATS["int4_cpu_group_experts"], (("group_size", 32),), part="cpu_experts"
    )
    assert isinstance(experts.fmt, ExpertLayerFormat) and experts.fmt.group_size == 32
    assert experts.stacks_experts and experts.part == "cpu_experts"


def test_with_params_records_and_applies_them() -> None:
    t = Target.writing(EXPERT_FORMATS["int4_cpu_group_experts"])
    got = t.with_params((("group_size", 64),))
    assert got.fmt.group_size == 64 and got.params == (("group_size", 64),)  # type: ignore[union-attr]


def test_an_inconsistent_target_is_refused() -> None:
    with pytest.raises(HetquantError, match="a copy target takes a format only to convert"):
        Target(Action.COPY, FORMATS["bf16"])
    with pytest.raises(HetquantError, match="a convert target takes a format only to convert"):
        Target(Action.CONVERT)
    with pytest.raises(HetquantError, match=r"params \['group_size'\] are not applied"):
        Target(Action.CONVERT, FORMATS["awq_w4a16"], (("group_size", 64),))  # default 128
    with pytest.raises(HetquantError, match=r"params \['nope'\] are not applied"):
        Target(Action.CONVERT, FORMATS["awq_w4a16"], (("nope", 1),))


def test_keep_is_a_copy_or_an_exact_bf16() -> None:
    assert keep("plain") == keep("bf16") == COPY_TARGET
    assert keep("fp8_block").fmt == FORMATS["bf16"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_rule_tables_hold_format_objects_or_choices(recipe: str) -> None:
    for cls, rule in getattr(RECIPES[recipe], "rules", {}).items():
        assert isinstance(rule, (WeightFormat, ExpertLayerFormat, Choice)), (cls, rule)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_job_has_a_kind_and_its_target_a_format(recipe: str) -> None:
    plan = plan_for(SourceCheckpoint.open(TINY), RECIPES[recipe], 1 << 20)
    for job in plan.jobs:
        assert isinstance(job.kind, JobKind)
        assert pickle.loads(pickle.dumps(job.target)) == job.target
        if job.kind is JobKind.COPY:
            assert job.target.action is Action.COPY and job.target.fmt is None
            continue
        assert job.target.action is Action.CONVERT
        want = ExpertLayerFormat if job.kind is JobKind.EXPERTS else WeightFormat
        assert isinstance(job.target.fmt, want)
        assert job.target.stacks_experts is (job.kind is JobKind.EXPERTS)
