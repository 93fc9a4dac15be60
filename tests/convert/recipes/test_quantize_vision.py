"""``--quantize-vision`` (``convert/recipes/quantized.py``, ``formats/families/vlm.py``): the
Ascend recipes write the vision linears msModelSlim quantizes (Qwen3-VL blocks' attn.qkv,
attn.proj, mlp.linear_fc1) in W8A8_DYNAMIC, described for vllm-ascend; nothing else changes.
Every other recipe, and a model without a vision tower, is refused with one line, nothing
written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hetquant.convert import SourceCheckpoint
from hetquant.convert.recipes import get_recipe
from hetquant.convert.verify import verify_artifact
from hetquant.formats import get_format
from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.serving.run import RunSpec, run_artifact

ASCEND = ["ascend-w8a8", "ascend-hybrid", "ascend-w4a8", "ascend-w4a16"]
QUANTIZED = ("attn.qkv", "attn.proj", "mlp.linear_fc1")  # msModelSlim's Qwen3-VL-MoE W8A8
TOKENS = (5, 17, 42, 100, 7)


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.rglob("*.safetensors")):
        rel = f.parent.relative_to(root).as_posix()
        out |= {f"{rel}/{k}": v for k, v in load_file(str(f)).items()}
    return out


def _quantized(module: str) -> bool:
    return module.startswith("model.visual.blocks.") and module.endswith(QUANTIZED)


@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [(r, "bf16") for r in ASCEND] + [("ascend-w8a8", "fp8"), ("ascend-w4a8", "fp8")],
)
def test_ascend_recipes_quantize_the_vision_linears_msmodelslim_does(
    cli, recipe: str, dtype: str, tiny_qwen3_vl: dict[str, Path], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The listed vision linears are W8A8_DYNAMIC within the format's bound, described so; every
    other vision tensor is at source precision (exact); every other tensor's bytes are those of
    the artifact without the option; the text path gives the same logits."""
    root = tiny_qwen3_vl[dtype]
    outs = {}
    for label, extra in (("plain", []), ("vision", ["--quantize-vision"])):
        outs[label] = tmp_path / label
        res = cli("convert", root, outs[label], "--recipe", recipe, *extra)
        assert res.exit_code == 0, res.stderr
    assert verify_artifact(outs["vision"]) == []
    src = SourceCheckpoint.open(root)
    art = open_artifact(outs["vision"])
    whole = art.load(ParallelLayout())
    desc = json.loads((outs["vision"] / "quant_model_description.json").read_text())
    modules = {n.rpartition(".")[0] for n in src.tensors if n.startswith("model.visual.")}
    w8a8 = get_format("w8a8_dynamic")
    for module in sorted(modules):
        fmt = art.modules[module].fmt
        if _quantized(module):
            assert fmt is not None and fmt.name == "w8a8_dynamic", module
            assert desc[f"{module}.weight"] == "W8A8_DYNAMIC", module
            stored = {
                k: whole[f"{module}.{k}"] for k in ("weight", "weight_scale", "weight_offset")
            }
            w = src.dequantized(f"{module}.weight").float()
            err = (w8a8.dequantize(stored) - w).abs()  # (n, k)
            assert bool((err <= stored["weight_scale"] / 2).all()), module  # round to nearest
            assert torch.equal(whole[f"{module}.bias"], src.weight(f"{module}.bias"))
            assert desc[f"{module}.bias"] == "FLOAT"
        else:
            assert fmt is None or fmt.name == "bf16", (module, fmt)
            for n in (n for n in src.tensors if n.rpartition(".")[0] == module):
                assert torch.equal(whole[n], src.dequantized(n)), n
                assert desc[n] == "FLOAT", n
    plain, vision = _tensors(outs["plain"]), _tensors(outs["vision"])
    changed = {k for k in vision if not (k in plain and torch.equal(plain[k], vision[k]))}
    assert changed and all(_quantized(k[2:].rpartition(".")[0]) for k in changed)
    assert set(plain) - set(vision) == set()
    ref, _ = run_artifact(RunSpec(str(outs["plain"]), TOKENS))
    got, _ = run_artifact(RunSpec(str(outs["vision"]), TOKENS))
    assert np.array_equal(ref, got)  # the reference forward is text-only: vision not read
    manifest = json.loads((outs["vision"] / "hetquant.json").read_text())
    assert manifest["recipe"]["options"] == {"quantize_vision": True}


def test_vision_linears_take_no_calibration(tiny_qwen3_vl: dict[str, Path]) -> None:
    """Calibration runs the text path: a quantized vision linear is neither searched nor scored."""
    src = SourceCheckpoint.open(tiny_qwen3_vl["bf16"])
    rec = get_recipe("ascend-hybrid").with_options({"quantize_vision": True})
    qkv = src.tensors["model.visual.blocks.0.attn.qkv.weight"].role
    assert rec.assign(qkv, "plain").name == "w8a8_dynamic" and rec.calibration(qkv) is None
    attn = src.tensors["model.language_model.layers.0.self_attn.q_proj.weight"].role
    assert rec.calibration(attn) == "quantized"


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "fmt"),
    [("awq-w4a16", "awq_w4a16"), ("fp4", "nvfp4_ascend"), ("ct-w4a16", "ct_pack_quantized")],
)
def test_a_recipe_whose_engine_reads_no_quantized_vision_refused(
    cli, recipe: str, fmt: str, tiny_qwen3_vl: dict[str, Path], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    res = cli("convert", tiny_qwen3_vl["bf16"], out, "--recipe", recipe, "--quantize-vision")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: model.visual.blocks.0.attn.qkv: recipe " + recipe)
    assert f"to {fmt}" in lines[0] and "vllm-ascend reads w8a8_dynamic" in lines[0]
    assert not out.exists()


def test_bf16_takes_no_quantize_vision(cli, tiny_qwen3_vl: dict[str, Path], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    res = cli("convert", tiny_qwen3_vl["bf16"], out, "--recipe", "bf16", "--quantize-vision")
    assert res.exit_code == 2 and "has no option 'quantize_vision'" in res.stderr
    assert not out.exists()


def test_a_model_without_vision_refused(cli, tiny_src: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    res = cli("convert", tiny_src, out, "--recipe", "ascend-w8a8", "--quantize-vision")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "--quantize-vision" in line and "this model has none" in line
    assert not out.exists()
