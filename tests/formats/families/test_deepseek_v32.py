"""DeepSeek-V3.2: the indexer's tensors enter the role table, every recipe keeps them at source
precision (FP8 dequantized exactly to BF16, BF16 copied, FLOAT in Ascend descriptions), and run /
eval refuse the family (exit 2) instead of a forward without the indexer."""

from __future__ import annotations

import copy
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import INDEX, REPO, TINY, bf16_bits, read_json, st_bytes, write_json

from hetquant.convert import SourceCheckpoint
from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig, expected_tensors, get_family

GEN = runpy.run_path(str(REPO / "examples" / "deepseek-v32" / "make_tiny.py"))
RECIPES = ["bf16", "ascend-hybrid", "ascend-w8a8", "awq-w4a16", "fp4"]
INDEXER = "model.layers.{}.self_attn.indexer."
FP8_PARTS = ("wq_b", "wk")
PLAIN_PARTS = ("k_norm.weight", "k_norm.bias", "weights_proj.weight")


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v32") / "DeepSeek-V3.2"
    GEN["write_checkpoint"](out)
    return out


@pytest.fixture(scope="module")
def artifacts(v32: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hetquant.convert import convert, get_recipe

    base = tmp_path_factory.mktemp("v32-art")
    src = SourceCheckpoint.open(v32)
    for r in RECIPES:
        convert(src, base / r, get_recipe(r), max_shard_size=1 << 40)
    return {r: base / r for r in RECIPES}


def test_config_and_role_table() -> None:
    cfg = ModelConfig.from_dict(copy.deepcopy(GEN["CONFIG"]))
    assert cfg.family is get_family("deepseek_v32")
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (3, 64, 8)
    names = expected_tensors(cfg)
    for layer in range(cfg.total_layers):  # the MTP layer too
        p = INDEXER.format(layer)
        assert names[p + "wq_b.weight"].shape == (192, cfg.q_lora_rank)
        assert names[p + "wk.weight"].shape == (64, cfg.hidden_size)
        assert names[p + "k_norm.bias"].shape == (64,)
        assert names[p + "weights_proj.weight"].shape == (3, cfg.hidden_size)
    assert {r.group for r in get_family("deepseek_v32").roles if r.kept} == {"indexer"}
    assert not any(r.kept for r in get_family("deepseek_v3").roles)


def test_missing_indexer_field_is_refused() -> None:
    raw = copy.deepcopy(GEN["CONFIG"])
    del raw["index_topk"]
    with pytest.raises(HetquantError, match=r"missing field.*index_topk"):
        ModelConfig.from_dict(raw)


def test_source_without_indexer_is_refused(tmp_path: Path) -> None:
    """A V3 checkpoint that says deepseek_v32 lacks the indexer tensors the config implies."""
    src = Path(shutil.copytree(TINY, tmp_path / "src"))
    cfg = read_json(src / "config.json")
    cfg.update(model_type="deepseek_v32", index_n_heads=3, index_head_dim=64, index_topk=8)
    write_json(src / "config.json", cfg)
    with pytest.raises(
        HetquantError, match=r"lacks tensors? 'model\.layers\.0\.self_attn\.indexer"
    ):
        SourceCheckpoint.open(src)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_keeps_the_indexer(recipe: str, v32: Path, artifacts: dict[str, Path]) -> None:
    src = SourceCheckpoint.open(v32)
    out = artifacts[recipe]
    index = read_json(out / INDEX)["weight_map"]
    for layer in (0, 2, 3):  # dense, MoE, MTP
        p = INDEXER.format(layer)
        for part in FP8_PARTS:  # dequantized exactly, as DeepSeek's formula
            name = f"{p}{part}.weight"
            assert f"{name}_scale_inv" not in index
            got = np.frombuffer(st_bytes(out / index[name], name), dtype=np.uint16)
            assert np.array_equal(got, bf16_bits(src.dequantized(name)).reshape(-1)), name
        for part in PLAIN_PARTS:  # copied byte for byte
            name = p + part
            assert st_bytes(out / index[name], name) == st_bytes(v32 / src.tensors[name].parts[
                part.rpartition(".")[2]][0], name)  # fmt: skip
    if recipe.startswith("ascend"):
        desc = read_json(out / "quant_model_description.json")
        kept = {k: v for k, v in desc.items() if ".indexer." in k}
        assert kept and set(kept.values()) == {"FLOAT"}


def test_run_and_eval_refuse_v32(cli, artifacts: dict[str, Path], v32: Path) -> None:
    art = artifacts["bf16"]
    assert cli("verify", art).exit_code == 0
    text = REPO / "examples" / "tiny-tools" / "heldout.txt"
    for args in (
        ("run", art, "--tokens", "1,2,3"),
        ("eval", art, "--reference", v32, "--text", text),
    ):
        res = cli(*args)
        assert res.exit_code == 2, (args[0], res.stderr)
        assert "lightning indexer" in res.stderr and res.stderr.count("\n") == 1, res.stderr
