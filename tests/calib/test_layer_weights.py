"""A layer's weights and what its linears see (``calib/layer_weights.py``): the capture joins and
refuses, each routed expert's tokens, and the routed-expert sum equal to the runtime's
``routed_experts`` bit for bit on the CPU (index-put per slot instead of ``index_add_``)."""

from __future__ import annotations

import pytest
import torch

from hetquant.calib.layer_weights import Capture, LayerWeights, layer_names
from hetquant.formats import HetquantError
from hetquant.runtime.forward.moe import routed_experts

D, INTER, EXPERTS, LAYER = 8, 6, 5, 1


def test_capture_joins_a_linears_inputs_once() -> None:
    cap = Capture()
    a, b = torch.randn(3, D), torch.randn(2, D)
    for m in ("q", "k"):  # two linears reading the same activations
        cap.linear(m, a)
        cap.linear(m, b)
    got = cap.input("q")
    assert torch.equal(got, torch.cat([a, b])) and cap.input("k") is got
    cap.linear("o", a)
    assert cap.input("o") is a
    with pytest.raises(HetquantError, match="linear v saw no input"):
        cap.input("v")


def test_capture_routing_and_expert_tokens() -> None:
    cap = Capture()
    with pytest.raises(HetquantError, match="no routing was captured"):
        cap.expert_tokens(EXPERTS)
    x = torch.randn(4, D)
    cap.routing(x[:2], torch.tensor([[0, 2], [2, 3]]))  # one call per sequence
    cap.routing(x[2:], torch.tensor([[3, 0], [1, 0]]))
    assert torch.equal(cap.moe_input, x)
    tokens = [t.tolist() for t in cap.expert_tokens(EXPERTS)]
    assert tokens == [[0, 2, 3], [3], [0, 1], [1, 2], []]


def _expert_state(family) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {}
    for e in range(EXPERTS):
        gate, up, down = family.mlp_modules("routed", LAYER, e)
        state[f"{gate}.weight"] = torch.randn(INTER, D, generator=g)
        state[f"{up}.weight"] = torch.randn(INTER, D, generator=g)
        state[f"{down}.weight"] = torch.randn(D, INTER, generator=g)
    return state


@pytest.mark.parametrize("limit", [None, 0.5])
def test_experts_equal_the_runtimes_routed_sum(tiny_source, limit) -> None:
    family = tiny_source.config.family
    w = LayerWeights(_expert_state(family), Capture(), family=family)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, D, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)
    got = w.experts(LAYER, x, ids, weights, limit)
    modules = lambda e: family.mlp_modules("routed", LAYER, e)  # noqa: E731
    want = routed_experts(w._expert_linear, modules, x, ids, weights, limit)
    assert torch.equal(got, want)
    assert torch.equal(w.capture.topk_ids, ids) and w.capture.moe_input is x


def test_weights_refuse_a_missing_tensor_and_cast_once(tiny_source) -> None:
    family = tiny_source.config.family
    w = LayerWeights({"a.weight": torch.ones(2, D)}, family=family)
    with pytest.raises(HetquantError, match=r"no tensor 'b\.weight'"):
        w.get("b.weight")
    bf = w.weight("a.weight", torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and w.weight("a.weight", torch.bfloat16) is bf
    names = ["model.layers.1.mlp.gate.weight", "model.layers.10.x", "model.layers.1.y"]
    assert layer_names(names, 1, family) == [names[0], names[2]]
