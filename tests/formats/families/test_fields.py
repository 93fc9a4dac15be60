"""Untrusted config.json fields (issue #25 §3): every field a family reads, of the wrong type or
out of range, is a HetquantError naming the file, the field, the value and what is expected —
through ``ConfigFields`` itself, each family's ``parse`` and the DeepSeek router fields."""

from __future__ import annotations

import math

import pytest
from support import TINY, make_tiny_qwen3, read_json

from hetquant.formats import HetquantError
from hetquant.formats.families import parse_config
from hetquant.formats.families.fields import INT_MAX, ConfigFields

DEEPSEEK = read_json(TINY / "config.json")
QWEN3 = make_tiny_qwen3().CONFIG

# values no integer field accepts: a string, a numeric string, a float, a bool, a negative, a
# list, an object, one past the cap
NOT_COUNTS = ["abc", "3", 3.0, True, -1, [3], {"n": 3}, INT_MAX + 1]
NOT_NUMBERS = ["small", True, -1.0, math.nan, math.inf, [1e-6]]
NOT_FLAGS = ["yes", 1, "false"]

DEEPSEEK_INTS = ["hidden_size", "vocab_size", "num_hidden_layers", "num_nextn_predict_layers",
                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
                 "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                 "moe_layer_freq"]  # fmt: skip
DEEPSEEK_POSITIVE = ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                     "q_lora_rank", "kv_lora_rank", "v_head_dim", "moe_layer_freq"]  # fmt: skip
QWEN3_INTS = ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
              "num_experts", "num_experts_per_tok", "decoder_sparse_step"]  # fmt: skip
QWEN3_POSITIVE = ["hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "moe_intermediate_size", "num_experts_per_tok",
                  "decoder_sparse_step"]  # fmt: skip
BAD_QUANT = [
    ("fp8", "quantization_config"),
    ([128, 128], "quantization_config"),
    ({"quant_method": 3}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "weight_block_size": 128}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": ["128", 128]},
     "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": 0},
     "quantization_config.scale_fmt"),
]  # fmt: skip


def _cases(base: dict, ints: list[str], positive: list[str]) -> list:
    cases = [(field, bad) for field in ints for bad in NOT_COUNTS]
    cases += [(field, 0) for field in positive]
    cases += [("rms_norm_eps", bad) for bad in NOT_NUMBERS]
    return [pytest.param(base, f, v, id=f"{f}={v!r}") for f, v in cases]


def _refused(raw: dict, *needles: str) -> str:
    with pytest.raises(HetquantError) as e:
        parse_config(raw, "origin.json")
    msg = str(e.value)
    assert all(n in msg for n in ("origin.json", *needles)), msg
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("base", "field", "bad"),
    _cases(DEEPSEEK, DEEPSEEK_INTS, DEEPSEEK_POSITIVE) + _cases(QWEN3, QWEN3_INTS, QWEN3_POSITIVE),
)
def test_wrong_typed_or_out_of_range_field(base: dict, field: str, bad: object) -> None:
    msg = _refused({**base, field: bad}, f"field {field} must be ", repr(bad)[:20])
    assert "integer" in msg or "number" in msg


@pytest.mark.parametrize("base", [DEEPSEEK, QWEN3], ids=["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize(("qc", "field"), BAD_QUANT)
def test_bad_quantization_config(base: dict, qc: object, field: str) -> None:
    _refused({**base, "quantization_config": qc}, f"field {field} must be ")


@pytest.mark.parametrize("bad", NOT_FLAGS)
def test_qwen3_flags_and_layer_lists(bad: object) -> None:
    _refused({**QWEN3, "norm_topk_prob": bad}, "field norm_topk_prob must be true or false")
    for layers in ("1", [-1], [1.5], [True], 3):
        _refused({**QWEN3, "mlp_only_layers": layers}, "field mlp_only_layers must be a list")


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [("num_experts_per_tok", "x", "an integer"), ("num_experts_per_tok", 0, "an integer"),
     ("n_group", 2.0, "an integer"), ("topk_group", False, "an integer"),
     ("norm_topk_prob", "yes", "true or false"), ("topk_method", 1, "one of noaux_tc, greedy, group_limited_greedy"),
     ("topk_method", "abc", "one of noaux_tc"),
     ("scoring_func", "tanh", "one of sigmoid, softmax"),
     ("routed_scaling_factor", "2.5", "a finite number"),
     ("routed_scaling_factor", 0, "a finite number > 0")],
)  # fmt: skip
def test_deepseek_router_fields(field: str, bad: object, expected: str) -> None:
    # convert does not route, but the artifact carries them to every forward: parse checks them
    with pytest.raises(HetquantError, match=f"field {field} must be {expected}"):
        parse_config({**DEEPSEEK, field: bad})
    absent = {k: v for k, v in DEEPSEEK.items() if k != "topk_method"}
    with pytest.raises(HetquantError, match="lacks topk_method"):
        parse_config(absent).router()  # an absent one: refused by the forward that needs it


def test_accessor_rules() -> None:
    f = ConfigFields({"a": 3, "b": None, "t": True, "s": "x" * 500, "o": {"k": "v"}}, "c.json")
    assert f.integer("a") == 3 and f.integer("b", 7) == 7 and f.integer("zz", None) is None
    with pytest.raises(HetquantError, match=r"c\.json: field b is missing \(or null\)"):
        f.integer("b")
    with pytest.raises(HetquantError, match=r"field a must be an integer in \[4, "):
        f.integer("a", lo=4)
    assert f.number("a") == 3.0 and isinstance(f.number("a"), float)
    with pytest.raises(HetquantError) as e:
        f.integer("s")
    assert len(str(e.value)) < 250 and "..." in str(e.value)  # a huge value is cut, not echoed
    with pytest.raises(HetquantError, match=r"field o\.k must be an integer"):
        f.mapping("o").integer("k")
    assert f.mapping("missing").raw == {} and f.flag("t") is True
    with pytest.raises(HetquantError, match=r"missing field\(s\) p, q; hint"):
        f.require(["a", "p", "q"], "hint")
