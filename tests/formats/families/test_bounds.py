"""A config's counts against the index (issue #25 §3): refused before any name is expanded."""

from __future__ import annotations

import tracemalloc

import pytest
from support import INDEX, TINY, make_tiny_qwen3, read_json

from hetquant.formats import HetquantError
from hetquant.formats.families import check_index_holds, expected_tensors, parse_config
from hetquant.formats.families.bounds import expected_count

NAMES = list(read_json(TINY / INDEX)["weight_map"])  # scales included, as an index holds them
RAW = read_json(TINY / "config.json")


def _check(names: list[str], **changes: object) -> None:
    check_index_holds(parse_config({**RAW, **changes}), names, "index.json")


def test_the_checkpoints_own_config_holds() -> None:
    cfg = parse_config(RAW)
    check_index_holds(cfg, NAMES, "index.json")
    assert expected_count(cfg) == len(expected_tensors(cfg))
    qwen = parse_config(make_tiny_qwen3().CONFIG)
    assert expected_count(qwen) == len(expected_tensors(qwen))


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"n_routed_experts": 10**6}, ("1000000 routed experts", f"only {len(NAMES)} tensors")),
        ({"num_nextn_predict_layers": 10**6}, ("1000003 decoder layers", "3 + 1000000 MTP")),
        ({"num_hidden_layers": 10**5}, ("100001 decoder layers", f"only {len(NAMES)} tensors")),
        ({"num_hidden_layers": 2**31 - 2}, ("2147483647 decoder layers",)),
        ({"num_hidden_layers": 4}, ("5 decoder layers (4 + 1 MTP)", "names layers 0..3 only")),
        ({"n_routed_experts": 16, "n_group": 1}, ("16 routed experts", "experts 0..7 only")),
    ],
)
def test_claims_beyond_the_index_are_refused(changes: dict, needles: tuple[str, ...]) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(HetquantError) as e:
            _check(NAMES, **changes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert all(n in msg for n in ("config.json claims", "index.json", *needles)), msg
    assert peak < 4 * 2**20, peak  # no per-name structure was built


def test_ids_alone_do_not_bound_the_expansion() -> None:
    # one crafted name carries expert id 199: the ids agree with the config, the count does not
    names = [*NAMES, "model.layers.1.mlp.experts.199.gate_proj.weight"]
    with pytest.raises(HetquantError, match=r"claims 1,8\d\d tensors .* names 240"):
        _check(names, n_routed_experts=200, n_group=1)


def test_fewer_claims_are_left_to_role_matching() -> None:
    _check(NAMES, num_nextn_predict_layers=0)  # the MTP layer's tensors: refused by name later
    _check(NAMES, n_routed_experts=4, n_group=1)
