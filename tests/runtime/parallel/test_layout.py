"""ParallelLayout, without a model: stages, coordinates, expert ownership, expert-count checks."""

from __future__ import annotations

import pytest

from hetquant.formats import HetquantError
from hetquant.runtime import ParallelLayout
from hetquant.runtime.parallel.layout import pp_partition


# ---- pipeline stages ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    [
        (61, 2, (31, 30)),  # vLLM get_pp_indices: remainder before the last stage
        (61, 4, (15, 15, 16, 15)),
        (62, 4, (15, 16, 16, 15)),
        (3, 2, (2, 1)),
        (4, 4, (1, 1, 1, 1)),
        (5, 1, (5,)),
    ],
)
def test_pp_partition_follows_vllm(layers: int, pp: int, want: tuple[int, ...]) -> None:
    assert pp_partition(layers, pp) == want


def test_stages_are_contiguous_and_cover_every_layer() -> None:
    stages = [ParallelLayout(pp_size=4, pp_rank=r).stage_layers(61) for r in range(4)]
    assert [list(s) for s in stages] == [
        list(range(0, 15)),
        list(range(15, 30)),
        list(range(30, 46)),
        list(range(46, 61)),
    ]
    assert ParallelLayout(pp_size=4, pp_rank=0).is_first_stage
    assert ParallelLayout(pp_size=4, pp_rank=3).is_last_stage


def test_pp_layers_override_and_refusals() -> None:
    lay = ParallelLayout(pp_size=2, pp_rank=1, pp_layers=(1, 2))
    assert list(lay.stage_layers(3)) == [1, 2]
    with pytest.raises(HetquantError, match="sum to 3, but the model has 4"):
        lay.stage_layers(4)
    with pytest.raises(HetquantError, match="must give 2 stage sizes"):
        ParallelLayout(pp_size=2, pp_layers=(3,))
    with pytest.raises(HetquantError, match=r"valid pp sizes: 1\.\.3"):
        ParallelLayout(pp_size=4).stage_layers(3)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank 2 is outside 0..1"),
        ({"tp_size": 0}, "tp_size must be an integer >= 1"),
        ({"ep_size": 2, "ep_rank": -1}, "ep_rank -1"),
        ({"physical_to_logical": ((),)}, "non-empty"),
        ({"accel_experts": -1}, ">= 0"),
        ({"accel_experts": "all"}, "accel_experts must be"),
    ],
)
def test_bad_coordinates_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(HetquantError, match=needle):
        ParallelLayout(**kwargs)


def test_layout_is_frozen_and_hashable() -> None:
    lay = ParallelLayout(tp_size=2, accel_experts={2: [5, 1], 1: (3,)})
    assert lay.accel_experts == ((1, (3,)), (2, (1, 5)))
    assert hash(lay) == hash(ParallelLayout(tp_size=2, accel_experts={1: [3], 2: [1, 5]}))
    with pytest.raises(AttributeError):
        lay.tp_size = 4  # type: ignore[misc]


# ---- experts ------------------------------------------------------------------------------------
def test_contiguous_expert_blocks_without_a_map() -> None:
    owned = [ParallelLayout(ep_size=4, ep_rank=r).owned_experts(0, 8) for r in range(4)]
    assert owned == [(0, 1), (2, 3), (4, 5), (6, 7)]
    with pytest.raises(
        HetquantError, match=r"ep_size 3 does not divide .*valid ep sizes: 1, 2, 4, 8"
    ):
        ParallelLayout(ep_size=3).expert_slots(0, 8)


def test_redundant_map_nine_slots_two_ranks() -> None:
    phy2log = ((3, 1, 0, 2, 7, 6, 5, 4, 3),)  # expert 3 replicated
    ranks = [ParallelLayout(ep_size=2, ep_rank=r, physical_to_logical=phy2log) for r in range(2)]
    assert [list(r.expert_slots(0, 8)) for r in ranks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [r.owned_experts(0, 8) for r in ranks] == [(3, 1, 0, 2, 7), (6, 5, 4, 3)]
    assert set().union(*(r.owned_experts(0, 8) for r in ranks)) == set(range(8))


def test_map_rows_per_layer() -> None:
    rows = ((0, 1, 2, 3), (3, 2, 1, 0))
    lay = ParallelLayout(ep_size=2, ep_rank=0, physical_to_logical=rows)
    assert lay.owned_experts(1, 4) == (3, 2)
    with pytest.raises(HetquantError, match="needs one"):
        lay.owned_experts(2, 4)


def test_accel_ids() -> None:
    assert ParallelLayout().accel_ids(1, 8) is None
    assert ParallelLayout(accel_experts=3).accel_ids(1, 8) == {0, 1, 2}
    mapped = ParallelLayout(accel_experts={1: [6, 2]})
    assert mapped.accel_ids(1, 8) == {2, 6}
    assert mapped.accel_ids(2, 8) == frozenset()


def test_first_slots_count_each_redundant_expert_once() -> None:
    # 9 physical slots over 8 experts: expert 3 is replicated in slot 8
    lay = ParallelLayout(ep_size=2, ep_rank=0, physical_to_logical=((0, 1, 2, 3, 4, 5, 6, 7, 3),))
    first = lay.first_slots(0, 8)
    assert first[3] == 3 and first[7] == 7 and len(first) == 8
    assert ParallelLayout().first_slots(0, 4) == {0: 0, 1: 1, 2: 2, 3: 3}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"physical_to_logical": ((0, 1, 2, 3),) * 4},
            r"4 rows; give 1 .*2 \(MoE layers \(1, 2\)\) or 3",
        ),
        ({"physical_to_logical": ((0, 1, 2, 4),)}, r"bad: \[4\], without a slot: \[3\]"),
        ({"physical_to_logical": ((0, 1, 2),)}, r"without a slot: \[3\]"),
        ({"ep_size": 8, "physical_to_logical": ((0, 1, 2, 3, 0),)}, "5 slots for ep_size 8"),
        ({"ep_size": 3}, "ep_size 3 does not divide the 4 routed experts"),
        ({"accel_experts": {2: [1, 4]}}, r"accel_experts\[2\] names experts >= 4: \[1, 4\]"),
    ],
)
def test_expert_coordinates_checked_against_the_model(kwargs: dict, needle: str) -> None:
    # 4 routed experts in MoE layers 1, 2, 3 (3 is the MTP layer of a 3-layer model)
    with pytest.raises(HetquantError, match=needle):
        ParallelLayout(**kwargs).check_experts(4, (1, 2, 3), 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"physical_to_logical": ((0, 1, 2, 3, 1),) * 3, "ep_size": 5},  # one row per MoE layer
        {"physical_to_logical": ((3, 2, 1, 0),) * 2, "ep_size": 2},  # the main layers only
        {"ep_size": 4, "accel_experts": {1: [3]}},
        {"accel_experts": 9},  # a count: the experts there are
    ],
)
def test_expert_coordinates_that_fit(kwargs: dict) -> None:
    ParallelLayout(**kwargs).check_experts(4, (1, 2, 3), 3)
