"""``keep_dense_down`` (``--keep-dense-down``): the dense layers' MLP down_proj kept at source
precision (FLOAT in the Ascend description), everything else as the recipe's rules say; not
calibrated; refused by the recipes without the option."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import TINY, read_json, tree_hashes
from test_bad_input import assert_refused

from hetquant.convert import (
    SourceCheckpoint,
    SourceItem,
    calibration_targets,
    get_recipe,
    make_plan,
    plan_for,
)
from hetquant.convert.recipes.quantized import role_class
from hetquant.formats import HetquantError
from hetquant.formats.families import load_json
from hetquant.runtime.serving.run import local_model

DENSE = "model.layers.0.mlp"  # the tiny model's one dense layer (first_k_dense_replace 1)


def _rules(recipe: str, keep: bool) -> dict[str, str]:
    """Linear weight name → target format of the plan (``bf16`` for KEEP)."""
    rec = get_recipe(recipe).with_options({"keep_dense_down": keep})
    plan = plan_for(SourceCheckpoint.open(TINY), rec, 1 << 40)
    return {n: job.target.name for job in plan.jobs for n in job.sources}


@pytest.mark.parametrize("recipe", ["ascend-hybrid", "ascend-w8a8", "ascend-w4a8", "ascend-w4a16"])
def test_only_the_dense_down_proj_changes(recipe: str) -> None:
    off, on = _rules(recipe, False), _rules(recipe, True)
    changed = {n for n in off if off[n] != on[n]}
    assert changed == {f"{DENSE}.down_proj.weight"}
    assert off[f"{DENSE}.down_proj.weight"] == "w8a8_dynamic"
    assert on[f"{DENSE}.down_proj.weight"] != "w8a8_dynamic"  # kept: the source's precision
    assert on[f"{DENSE}.up_proj.weight"] == on["model.layers.1.mlp.shared_experts.down_proj.weight"] == "w8a8_dynamic"  # fmt: skip


def test_kept_down_proj_is_not_calibrated() -> None:
    rec = get_recipe("ascend-hybrid").with_options({"keep_dense_down": True})
    targets, _ = calibration_targets(plan_for(SourceCheckpoint.open(TINY), rec, 1 << 40))
    assert f"{DENSE}.down_proj.weight" not in targets
    assert f"{DENSE}.up_proj.weight" in targets


def test_cli_writes_float_down_proj_and_runs(cli, tmp_path: Path) -> None:
    out = tmp_path / "hybrid"
    res = cli("convert", TINY, out, "--recipe", "ascend-hybrid", "--keep-dense-down")
    assert res.exit_code == 0, res.stderr
    assert read_json(out / "hetquant.json")["recipe"]["options"] == {"keep_dense_down": True}
    desc = load_json(out / "quant_model_description.json")
    assert desc[f"{DENSE}.down_proj.weight"] == "FLOAT"
    assert desc[f"{DENSE}.up_proj.weight"] == desc[f"{DENSE}.gate_proj.weight"] == "W8A8_DYNAMIC"
    assert cli("verify", out).exit_code == 0
    src = SourceCheckpoint.open(TINY)
    weights = local_model(out, device="cpu").weights
    kept = weights.get(f"{DENSE}.down_proj.weight")
    assert torch.equal(kept, src.dequantized(f"{DENSE}.down_proj.weight"))


def test_recipes_without_the_option_refuse_it(cli, tiny_src: Path, tmp_path: Path) -> None:
    before = tree_hashes(tiny_src)
    res = cli("convert", tiny_src, tmp_path / "out", "--recipe", "awq-w4a16", "--keep-dense-down")
    assert_refused(res, tiny_src, tmp_path / "out", before, "no option 'keep_dense_down'")


def test_qwen3_moe_mlp_only_layer_is_kept(cli, tiny_qwen3: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"  # the tiny Qwen3-MoE's layer 1 is dense (``mlp_only_layers``)
    res = cli("convert", tiny_qwen3["fp8"], out, "--recipe", "ascend-w8a8", "--keep-dense-down")
    assert res.exit_code == 0, res.stderr
    desc = load_json(out / "quant_model_description.json")
    assert desc["model.layers.1.mlp.down_proj.weight"] == "FLOAT"
    assert desc["model.layers.1.mlp.up_proj.weight"] == "W8A8_DYNAMIC"


def test_a_model_without_dense_layers_refuses_it() -> None:
    src = SourceCheckpoint.open(TINY)
    items = [  # the tiny model without its dense layer 0: every layer MoE
        SourceItem(t.name, t.role, t.dtype, t.fmt_name, t.fmt_params)
        for t in src.tensors.values()
        if role_class(t.role) != "dense"
    ]
    rec = get_recipe("ascend-hybrid").with_options({"keep_dense_down": True})
    with pytest.raises(HetquantError, match=r"--keep-dense-down .* has none .* drop it"):
        make_plan(items, rec, 1 << 40)
    make_plan(items, get_recipe("ascend-hybrid"), 1 << 40)  # without the option: planned
