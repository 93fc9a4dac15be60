"""Qwen3-MoE sources (FP8 128-block and BF16) through every recipe, and their bad inputs.

Every recipe converts both tiny sources (``examples/tiny-qwen3-moe/make_tiny.py``: a 64-row
k/v_proj, a partial FP8 block; scales in another shard than their weights), the artifact
verifies, and loads at TP2: a quantized module's TP halves dequantize to exactly the rows /
columns of the whole (the formats split on their own units), and within the format's error of
the source. ``bf16`` of the FP8 source is the source's exact dequantization.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetquant.convert import SourceCheckpoint, convert, get_recipe, verify_artifact
from hetquant.formats import HetquantError
from hetquant.runtime import ParallelLayout, open_artifact

RECIPES = ["bf16", "ascend-hybrid", "ascend-w8a8", "awq-w4a16", "fp4"]
K = "model.layers.2.self_attn.k_proj"  # [64, 256]: a partial FP8 block
DOWN = "model.layers.0.mlp.experts.3.down_proj"  # row-parallel
# relative error bound per format (max |Δ| / max |w|): 8-bit per channel, 4-bit per group / channel
BOUND = {"w8a8_dynamic": 0.01, "awq_w4a16": 0.1, "nvfp4_ascend": 0.2}


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_on_both_sources(
    recipe: str, dtype: str, tiny_qwen3: dict[str, Path], tmp_path: Path
) -> None:
    src = SourceCheckpoint.open(tiny_qwen3[dtype])
    out = tmp_path / recipe
    convert(src, out, get_recipe(recipe), max_shard_size=1 << 20)
    assert verify_artifact(out) == []
    art = open_artifact(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    whole = art.load(ParallelLayout())
    if recipe == "fp4":  # the Ascend FP4 tile is 256 rows: a 256-row expert does not split
        with pytest.raises(HetquantError, match=r"not a multiple of 256.*valid tp sizes: 1$"):
            art.check(ParallelLayout(tp_size=2))
        halves = [whole]
    else:
        halves = [art.load(ParallelLayout(tp_size=2, tp_rank=r)) for r in range(2)]
    for module, dim in ((K, 0), (DOWN, 1)):
        if module not in art.modules:  # ascend-hybrid: routed experts live in cpu_experts/
            assert recipe == "ascend-hybrid" and ".experts." in module
            continue
        source = src.dequantized(f"{module}.weight").float()
        info = art.modules[module]
        if (
            info.fmt is None or info.fmt.name == "bf16"
        ):  # kept at BF16: the source's exact dequantization, split as stored
            assert torch.equal(whole[f"{module}.weight"].float(), source)
            parts = [h[f"{module}.weight"] for h in halves]
            assert torch.equal(torch.cat(parts, dim=dim), whole[f"{module}.weight"])
            continue

        def deq(tensors: dict, info=info, module=module) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return info.fmt.dequantize({k: tensors[f"{module}.{k}"] for k in info.entries})

        full = deq(whole).float()
        assert torch.equal(torch.cat([deq(h).float() for h in halves], dim=dim), full)
        err = float((full - source).abs().max()) / float(source.abs().max())
        assert 0 < err < BOUND[info.fmt.name], (module, info.fmt.name, err)
    if recipe == "ascend-hybrid":
        pool = art.cpu_expert_pool()
        assert sorted(pool.layers) == [0, 2]  # layer 1 is dense (mlp_only_layers)
        assert "model.layers.1.mlp.down_proj" in art.modules


# ---- bad input -------------------------------------------------------------------------------


def _copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(root, dst)
    return dst


def _edit_shards(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Rewrite every shard through ``edit(tensors) -> tensors`` and the index to match."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(str(root / shard)))
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    index["weight_map"] = dict(sorted(weight_map.items()))
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _refused(cli, src: Path, tmp_path: Path, *needles: str) -> str:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    res = cli("convert", src, out, "--recipe", "bf16")
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in res.stderr
    assert all(n in line for n in needles), line
    assert not (out / "hetquant.json").exists()
    return line


def test_expert_tensors_missing_in_one_layer(cli, tiny_qwen3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = _copy(tiny_qwen3["fp8"], tmp_path)
    gone = "model.layers.2.mlp.experts.5."
    _edit_shards(src, lambda t: {n: v for n, v in t.items() if not n.startswith(gone)})
    _refused(cli, src, tmp_path, "lacks tensors", f"'{gone}gate_proj.weight'",
             f"'{gone}up_proj.weight'", f"'{gone}down_proj.weight'")  # fmt: skip


def test_fused_3d_experts_convert(cli, tiny_qwen3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """transformers' module layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in one layer
    instead of per-expert: converted, the experts read from the fused tensors bit-exactly
    (``tests/formats/test_fused_experts.py`` covers both orientations)."""
    src = _copy(tiny_qwen3["bf16"], tmp_path)
    p = "model.layers.0.mlp.experts"

    def fuse(t: dict) -> dict:
        mine = {n: v for n, v in t.items() if n.startswith(p + ".")}
        if not mine:
            return t
        out = {n: v for n, v in t.items() if n not in mine}
        e = range(8)
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat(
            [mine[f"{p}.{i}.gate_proj.weight"], mine[f"{p}.{i}.up_proj.weight"]]) for i in e])  # fmt: skip
        out[f"{p}.down_proj"] = torch.stack([mine[f"{p}.{i}.down_proj.weight"] for i in e])
        return out

    _edit_shards(src, fuse)
    res = cli("convert", src, tmp_path / "out", "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    ref = SourceCheckpoint.open(tiny_qwen3["bf16"])
    art = open_artifact(tmp_path / "out").load(ParallelLayout())
    name = f"{p}.5.up_proj.weight"
    assert torch.equal(art[name].view(torch.int16), ref.weight(name).view(torch.int16))


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, ("dense Qwen3", "out of scope")),
        ({"num_experts_per_tok": None}, ("MoE field", "num_experts_per_tok")),
    ],
)  # fmt: skip
def test_config_refused_through_the_cli(cli, tiny_qwen3, tmp_path: Path, change, needles) -> None:  # type: ignore[no-untyped-def]
    src = _copy(tiny_qwen3["bf16"], tmp_path)
    raw = json.loads((src / "config.json").read_text())
    raw = {k: v for k, v in {**raw, **change}.items() if v is not None}
    (src / "config.json").write_text(json.dumps(raw))
    _refused(cli, src, tmp_path, "config.json", *needles)


# ---- the CLI end to end: calibrated AWQ, eval, run -----------------------------------------

TEXT = Path(__file__).resolve().parents[3] / "examples" / "tiny-tools"


def test_calibrated_awq_eval_and_run(cli, tiny_qwen3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``convert --recipe awq-w4a16 --calib-data`` on the FP8 source (group 64), then ``eval``
    against the source and ``run`` at TP2 with generation."""
    src, out = tiny_qwen3["fp8"], tmp_path / "awq"
    res = cli("convert", src, out, "--recipe", "awq-w4a16", "--group-size", "64",
              "--calib-data", TEXT / "calib.txt", "--calib-samples", "4", "--calib-seq-len", "64")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    manifest = json.loads((out / "hetquant.json").read_text())
    assert manifest["calibration"]["method"] == "awq"
    assert manifest["calibration"]["options"]["clip_skip"] == ["q_proj", "k_proj"]
    report = tmp_path / "eval.json"
    res = cli("eval", out, "--reference", src, "--text", TEXT / "heldout.txt",
              "--samples", "2", "--seq-len", "64", "--json", report)  # fmt: skip
    assert res.exit_code == 0, res.stderr
    scores = json.loads(report.read_text())
    assert 0 < scores["kl"] < 1 and scores["top1"] > 0.2  # 4-bit on random weights: close
    res = cli("run", out, "--tokens", "5,17,42", "--tp", "2", "--generate", "2")
    assert res.exit_code == 0, res.stderr
    assert "logits [3, 640]" in res.stdout
