"""Every recipe converts the tiny Kimi K2 Instruct (model_type kimi_k2, awkward dims, no MTP) and
its artifact verifies; K2's tokenizer files are what the aux-file rule sends into the artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import make_kimi_k2, read_json

from hetquant.convert import SourceCheckpoint, convert, get_recipe, verify_artifact
from hetquant.convert.planning.aux_files import aux_files
from hetquant.convert.recipes import RECIPES as REGISTERED

RECIPES = sorted(REGISTERED)  # every recipe
K2_FILES = ["chat_template.jinja", "generation_config.json", "tiktoken.model",
            "tokenization_kimi.py", "tokenizer_config.json"]  # fmt: skip


@pytest.fixture(scope="module")
def instruct(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_kimi_k2(tmp_path_factory.mktemp("k2") / "Kimi-K2-Instruct")


def test_the_generator_writes_k2s_config(instruct: Path) -> None:
    cfg = read_json(instruct / "config.json")
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["n_group"], cfg["topk_group"], cfg["first_k_dense_replace"]) == (1, 1, 1)
    assert (cfg["routed_scaling_factor"], cfg["num_nextn_predict_layers"]) == (2.827, 0)
    assert cfg["rope_scaling"]["beta_fast"] == 1.0 and cfg["rope_scaling"]["factor"] == 32.0
    assert cfg["bos_token_id"] == cfg["vocab_size"] - 256  # K2: 163,584 of 163,840
    ranks = (instruct / "tiktoken.model").read_text().splitlines()
    assert len(ranks) == cfg["vocab_size"] - 256 and ranks[-1].endswith(f" {len(ranks) - 1}")


def test_aux_rule_carries_k2s_tokenizer(instruct: Path) -> None:
    assert aux_files(instruct).names == K2_FILES


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_converts_and_verifies(instruct: Path, tmp_path: Path, recipe: str) -> None:
    src = SourceCheckpoint.open(instruct)
    manifest = convert(src, tmp_path / "out", get_recipe(recipe), max_shard_size=1 << 40).manifest
    assert manifest is not None and manifest["complete"]
    assert read_json(tmp_path / "out" / "config.json")["model_type"] == "kimi_k2"
    assert verify_artifact(tmp_path / "out") == []
    for name in K2_FILES:  # the tokenizer travels, byte for byte, and the manifest hashes it
        assert (tmp_path / "out" / name).read_bytes() == (instruct / name).read_bytes()
        assert name in manifest["files"] and name in manifest["parts"]["root"]["files"]


@pytest.mark.parametrize("recipe", ["ct-w4a16", "ascend-w4a16"])
def test_thinking_artifacts_that_keep_its_int4_experts_verify(tmp_path: Path, recipe: str) -> None:
    """The manifest records the source's non-default format variant (``source.format_params``:
    group 32, not ct_pack_quantized's default 128), so ``verify`` replays the plan that kept the
    experts as stored instead of refusing a group 128 source that does not fit group 32."""
    thinking = make_kimi_k2(tmp_path / "thinking", "thinking")
    out = tmp_path / "out"
    manifest = convert(
        SourceCheckpoint.open(thinking), out, get_recipe(recipe), max_shard_size=1 << 40
    ).manifest
    assert manifest is not None
    variants = manifest["source"]["format_params"]
    want = {"group_size": 32, "shape_dtype": "I32"}  # ct_pack_quantized defaults: 128, I64
    assert variants == dict.fromkeys(("expert_gate", "expert_up", "expert_down"), want)
    assert verify_artifact(out) == []
    doc = read_json(out / "hetquant.json")
    del doc["source"]["format_params"]  # an artifact written before the key existed
    (out / "hetquant.json").write_text(json.dumps(doc))
    assert any("group 128" in p for p in verify_artifact(out))


@pytest.mark.parametrize(
    ("variant", "want"),
    [({"bogus": 1}, "bogus"), ({"group_size": "x"}, "group_size 'x' is not supported"),
     ({"group_size": 7}, "use one of"), ([1], "must be a JSON object")],
)  # fmt: skip
def test_a_damaged_format_params_is_one_failed_check(
    tmp_path: Path, variant: object, want: str
) -> None:
    """``source.format_params`` is untrusted: an unknown parameter, a wrong type or an unsupported
    value makes verify fail in one line naming it, nothing raised past it."""
    thinking = make_kimi_k2(tmp_path / "thinking", "thinking")
    out = tmp_path / "out"
    convert(SourceCheckpoint.open(thinking), out, get_recipe("ct-w4a16"), max_shard_size=1 << 40)
    doc = read_json(out / "hetquant.json")
    doc["source"]["format_params"]["expert_gate"] = variant
    (out / "hetquant.json").write_text(json.dumps(doc))
    problems = verify_artifact(out)
    assert len(problems) == 1 and "\n" not in problems[0] and want in problems[0], problems
