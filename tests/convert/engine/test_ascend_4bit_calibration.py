"""``ascend-w4a8`` / ``ascend-w4a16 --calib-data``: the routed experts AWQ-calibrated with their own
format as the quantizer (``w4a8_dynamic`` per row, ``ct_pack_quantized`` per group), the W8A8
linears written as the plain recipe writes them (scaled where the experts' mapping shares their
input), the routing kept within the BF16 fold bound (``test_hybrid_calibration.py``'s docstring),
the MTP layer round-to-nearest; refusals before anything is calibrated or written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ascend_4bit_cases import BAD, _bf16_source, _refused
from support import make_kimi_k2, read_json
from test_hybrid_calibration import (
    ATTENTION,
    CALIB,
    TINY,
    _one_thread,  # noqa: F401  (fixture)
    _root,
    assert_routing_kept,
    rtn_and_calibrated,
    text,  # noqa: F401  (fixture)
)

from hetquant.convert import (
    SourceCheckpoint,
    calibrate_for,
    calibration_targets,
    convert,
    get_recipe,
    plan_for,
)
from hetquant.formats import get_format

RECIPES = {"ascend-w4a8": "w4a8_dynamic", "ascend-w4a16": "ct_pack_quantized"}


@pytest.fixture(scope="module", params=sorted(RECIPES))
def arts(request, tmp_path_factory: pytest.TempPathFactory, text: Path) -> dict[str, Path]:  # noqa: F811
    """One recipe's tiny model round-to-nearest and calibrated, through the command line."""
    return rtn_and_calibrated(tmp_path_factory.mktemp(request.param), request.param, text)


def test_manifest_records_the_calibration_and_verify_passes(cli, arts) -> None:
    awq, rtn = (read_json(arts[k] / "hetquant.json") for k in ("awq", "rtn"))
    cal = awq["calibration"]
    assert cal["method"] == "awq" and cal["mtp"] == "rtn"
    assert (cal["tokens"]["samples"], cal["tokens"]["seq_len"]) == (4, 64)
    # the calibrated linears' formats: the experts' and the W8A8 ones the objectives score
    assert cal["options"]["quantizer"] == sorted([RECIPES[awq["recipe"]["name"]], "w8a8_dynamic"])
    assert "calibration" not in rtn  # as before these recipes calibrated (golden artifacts)
    assert awq["plan_digest"] != rtn["plan_digest"]
    assert awq["module_formats"] == rtn["module_formats"]  # same layout, other values
    for art in arts.values():
        res = cli("verify", art)
        assert res.exit_code == 0 and "OK" in res.stdout, res.stdout


def test_only_the_experts_mapping_changes(arts) -> None:
    """Searched: the routed experts (and down through up). Attention and the dense MLP are W8A8
    as in the plain recipe; the MoE input balance also scales the shared expert and folds into
    the norm and the router; the MTP layer is round-to-nearest."""
    awq, rtn = _root(arts["awq"]), _root(arts["rtn"])
    assert awq.keys() == rtn.keys()
    changed = {k for k in awq if not torch.equal(awq[k], rtn[k])}
    for layer in (0, 1, 2):
        for proj in ATTENTION:
            assert not any(f".layers.{layer}.self_attn.{proj}." in k for k in changed)
    assert not any(".layers.0.mlp." in k for k in changed)  # the dense layer: not searched
    assert not any(".layers.3." in k for k in changed)  # MTP: round-to-nearest
    for layer in (1, 2):
        p = f"model.layers.{layer}"
        assert f"{p}.post_attention_layernorm.weight" in changed
        assert f"{p}.mlp.gate.weight" in changed
        assert f"{p}.mlp.shared_experts.up_proj.weight" in changed
        for part in ("gate", "up", "down"):
            assert any(k.startswith(f"{p}.mlp.experts.") and f".{part}_proj." in k for k in changed)


def test_routing_is_kept(arts) -> None:
    assert_routing_kept(_root(arts["awq"]))


@pytest.mark.parametrize(
    ("recipe", "options", "group"),
    [("ascend-w4a8", {}, None), ("ascend-w4a16", {}, 32),
     ("ascend-w4a16", {"group_size": 128}, 128)],
)  # fmt: skip
def test_artifact_experts_are_the_calibrated_weights_quantized(
    recipe: str,
    options: dict,
    group: int | None,
    tmp_path: Path,
    text: Path,  # noqa: F811
) -> None:
    """Every stored routed-expert tensor is the target format's ``quantize`` of the calibrated
    weight, bit for bit; clips are per row (one column, w4a8) or per group (w4a16)."""
    src = SourceCheckpoint.open(TINY)
    rec = get_recipe(recipe).with_options(options) if options else get_recipe(recipe)
    plan = plan_for(src, rec, 1 << 40)
    targets, searched = calibration_targets(plan)
    assert {q.fmt.name for q in targets.values()} == {"w8a8_dynamic", RECIPES[recipe]}
    # searched: the routed experts (the MTP layer's too, which calibration does not reach:
    # w8a8_dynamic in ascend-w4a8, round-to-nearest in both)
    routed = {n for n in targets if ".mlp.experts." in n}
    assert searched == routed
    assert {targets[n].fmt.name for n in routed if ".layers.3." not in n} == {RECIPES[recipe]}
    cal = calibrate_for(src, plan, text, 2, 64, device="cpu")
    out = tmp_path / "out"
    convert(src, out, rec, max_shard_size=1 << 40, calibration=cal)
    root, formats = _root(out), read_json(out / "hetquant.json")["module_formats"]
    shrinks = 0
    for layer in (1, 2):
        for e in range(src.config.num_experts):
            for part in ("gate", "up", "down"):
                module = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj"
                fmt = get_format(formats[module]["format"], **formats[module]["params"])
                assert fmt.name == RECIPES[recipe]
                w = cal.apply(f"{module}.weight", src.dequantized(f"{module}.weight"))
                for key, want in fmt.quantize(w).items():
                    assert torch.equal(root[f"{module}.{key}"], want), f"{module}.{key}"
                t = cal.transforms.get(f"{module}.weight")
                if t is not None and t.shrink is not None:
                    shrinks += 1
                    n, k = w.shape
                    assert t.shrink.shape == (n, 1 if group is None else k // group)
    assert shrinks > 0


# ---- refusals: exit 2, one line, nothing written, nothing calibrated -----------------------


@pytest.mark.parametrize(("changes", "args", "want"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_refused_before_calibrating(
    cli,
    tmp_path: Path,
    text: Path,  # noqa: F811
    changes: dict,
    args: list,
    want: list,
) -> None:
    """The plain recipes' refusals (a group size the scheme cannot take, shapes that do not
    pack) come first with ``--calib-data`` too."""
    src = _bf16_source(tmp_path / "src", **changes) if changes else TINY
    _refused(cli, src, tmp_path / "o", [*args, "--calib-data", str(text), *CALIB], *want)


def test_k2_thinking_codes_kept_by_w4a16_refuse_calibration(cli, tmp_path: Path, text) -> None:  # noqa: F811
    src = make_kimi_k2(tmp_path / "src", "thinking")
    args = ["--recipe", "ascend-w4a16", "--calib-data", str(text), *CALIB]
    _refused(cli, src, tmp_path / "o", args, "repacked losslessly", "ct_pack_quantized",
             "--calib-data")  # fmt: skip
