"""Who computes what (``runtime/experts/_routing.py``): top-k choices grouped by expert (by hand),
a subpool's entries, the expert blocks of ``split="experts"``, refused options and top-k."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.runtime.experts._routing import (
    SPLITS,
    Routing,
    _check_options,
    _expert_block,
    _route,
)

THREE = SimpleNamespace(num_experts=3)  # _route reads only num_experts of the layer's info


def test_route_groups_entries_by_expert_stably() -> None:
    # token 0 picks experts (2, 0), token 1 (0, 1): flat [2, 0, 0, 1] in stable order of expert
    ids = torch.tensor([[2, 0], [0, 1]])
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0]], dtype=torch.bfloat16)
    r = _route(THREE, 1, torch.zeros(2, 4, dtype=torch.bfloat16), ids, w)
    assert r.experts.tolist() == [0, 1, 2]
    assert r.offsets.tolist() == [0, 2, 3, 4]
    assert r.tokens.tolist() == [0, 1, 1, 0]
    assert r.weights.dtype == torch.float32 and r.weights.tolist() == [0.25, 1.0, 2.0, 0.5]


def test_route_casts_weights_to_x_dtype_first() -> None:
    w = torch.tensor([[1.0 + 2**-10]])  # not a bfloat16 value
    r = _route(THREE, 0, torch.zeros(1, 4, dtype=torch.bfloat16), torch.tensor([[1]]), w)
    assert r.weights.tolist() == [1.0]
    r = _route(THREE, 0, torch.zeros(1, 4), torch.tensor([[1]]), w)
    assert r.weights.tolist() == [1.0 + 2**-10]


def test_owned_entries_of_an_expert_block() -> None:
    r = Routing(
        torch.tensor([0, 1, 2]),
        torch.tensor([0, 2, 3, 4]),
        torch.tensor([0, 1, 1, 0]),
        torch.tensor([0.25, 1.0, 2.0, 0.5]),
    )
    mine = r.owned(1, 3)
    assert mine is not None
    assert mine.experts.tolist() == [1, 2] and mine.offsets.tolist() == [0, 1, 2]
    assert mine.tokens.tolist() == [1, 0] and mine.weights.tolist() == [2.0, 0.5]
    assert r.owned(3, 5) is None


@pytest.mark.parametrize(("experts", "subpools"), [(8, 3), (256, 7), (5, 5), (3, 1)])
def test_expert_blocks_cover_every_expert_once(experts: int, subpools: int) -> None:
    blocks = [_expert_block(experts, s, subpools) for s in range(subpools)]
    assert blocks[0][0] == 0 and blocks[-1][1] == experts
    assert all(a < b for a, b in blocks)  # 1 <= S <= E: no subpool without an expert
    assert all(blocks[s][1] == blocks[s + 1][0] for s in range(subpools - 1))


@pytest.mark.parametrize(
    ("ids", "w", "match"),
    [
        (torch.tensor([[0, 1]]), torch.ones(2, 2), "must both be"),
        (torch.tensor([0, 1]), torch.ones(2), "must both be"),
        (torch.ones(2, 1), torch.ones(2, 1), "must be integers"),
        (torch.tensor([[0], [3]]), torch.ones(2, 1), r"outside 0\.\.2 \(layer 5\)"),
        (torch.tensor([[0], [-1]]), torch.ones(2, 1), "outside"),
    ],
)
def test_route_refuses(ids: torch.Tensor, w: torch.Tensor, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        _route(THREE, 5, torch.zeros(2, 4), ids, w)
    with pytest.raises(HetquantError, match=r"must be \[T, H\]"):
        _route(THREE, 5, torch.zeros(2, 1, 4), ids, w)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, "inter", "auto", "high"), "integer >= 1"),
        ((True, "inter", "auto", "high"), "integer >= 1"),
        ((2, "rows", "auto", "high"), "split 'rows' not in"),
        ((2, "experts", "cuda", "high"), "backend 'cuda'"),
        ((2, "experts", "auto", "low"), "precision 'low'"),
    ],
)
def test_check_options_refuses(args: tuple, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        _check_options(*args)
    assert SPLITS == ("inter", "experts")
    _check_options(2, "experts", "auto", "high")
