"""Qwen3-VL-MoE sources (BF16 fused experts, FP8 per expert) through every recipe, and the VLM
seam's properties and bad inputs (``formats/families/vlm.py``).

Every recipe converts both tiny sources (``examples/tiny-qwen3-vl-moe/make_tiny.py``: transformers'
own classes, vision tower included) and the artifact verifies; the vision tower stays at source
precision (the FP8 source's vision linears dequantized exactly); processor files travel. The
text decoder is quantized exactly as its text family's: the same bytes as converting the text
part alone, renamed, as a Qwen3-MoE checkpoint — calibrated AWQ included.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hetquant.convert import SourceCheckpoint, convert
from hetquant.convert.recipes import get_recipe
from hetquant.convert.verify import verify_artifact
from hetquant.formats import FORMATS, HetquantError
from hetquant.formats.families import parse_config
from hetquant.formats.families.qwen3_vl_moe import decoder_raw
from hetquant.runtime import ParallelLayout, open_artifact

RECIPES = ["bf16", "ascend-hybrid", "ascend-w4a16", "ascend-w4a8", "ascend-w8a8", "awq-w4a16",
           "ct-w4a16", "fp4"]  # fmt: skip
PROCESSOR = ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja")
TEXT = "model.language_model."
CALIB = Path(__file__).resolve().parents[2] / "examples" / "tiny-tools" / "calib.txt"


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under ``root``, keyed ``relative dir/name``."""
    out = {}
    for f in sorted(root.rglob("*.safetensors")):
        rel = f.parent.relative_to(root).as_posix()
        out |= {f"{rel}/{k}": v for k, v in load_file(str(f)).items()}
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_on_both_sources(
    recipe: str, dtype: str, tiny_qwen3_vl: dict[str, Path], tmp_path: Path
) -> None:
    src = SourceCheckpoint.open(tiny_qwen3_vl[dtype])
    out = tmp_path / recipe
    convert(src, out, get_recipe(recipe), max_shard_size=1 << 20)
    assert verify_artifact(out) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl_moe" and "vision_config" in cfg and "text_config" in cfg
    for f in PROCESSOR:
        assert (out / f).read_bytes() == (tiny_qwen3_vl[dtype] / f).read_bytes()
    art = open_artifact(out)
    whole = art.load(ParallelLayout())
    vision = [n for n in src.tensors if n.startswith("model.visual.")]
    assert len(vision) == 3 + 2 * 12 + 6 + 6  # patch/pos embed, 2 blocks, merger, deepstack
    for name in vision:  # at source precision: the exact dequantization, split as stored
        fmt = art.modules[name.rpartition(".")[0]].fmt
        assert fmt is None or fmt.name == "bf16", (name, fmt)
        assert torch.equal(whole[name], src.dequantized(name)), name
    if recipe != "fp4":  # the Ascend FP4 tile (256 rows) leaves the 512-row experts one split
        halves = [art.load(ParallelLayout(tp_size=2, tp_rank=r)) for r in range(2)]
        qkv = "model.visual.blocks.1.attn.qkv.weight"  # replicated
        assert all(torch.equal(h[qkv], whole[qkv]) for h in halves)


def _text_only(vl: Path, out: Path) -> Path:
    """The VLM source's text part as a Qwen3-MoE checkpoint: names back under ``model.``, the
    vision tower dropped, config.json the text family's (``decoder_raw``)."""
    out.mkdir(parents=True)
    index = json.loads((vl / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        kept = {("model." + n[len(TEXT) :] if n.startswith(TEXT) else n): t
                for n, t in load_file(str(vl / shard)).items()
                if not n.startswith("model.visual.")}  # fmt: skip
        save_file(kept, str(out / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(kept, shard)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = json.loads((vl / "config.json").read_text())
    text = decoder_raw(raw, "config.json") | {"architectures": ["Qwen3MoeForCausalLM"]}
    if "quantization_config" in raw:
        text["quantization_config"] = raw["quantization_config"]
    (out / "config.json").write_text(json.dumps(text))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((vl / f).read_bytes())
    return out


@pytest.mark.parametrize(
    ("dtype", "args"),
    [("bf16", ["--recipe", "ascend-hybrid"]), ("fp8", ["--recipe", "ascend-w4a8"]),
     ("fp8", ["--recipe", "fp4"]),
     ("bf16", ["--recipe", "awq-w4a16", "--calib-data", str(CALIB), "--calib-samples", "2",
               "--calib-seq-len", "32"])],
)  # fmt: skip
def test_text_decoder_quantized_as_its_text_family(
    cli, dtype: str, args: list[str], tiny_qwen3_vl: dict[str, Path], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Every stored tensor of the text-only Qwen3-MoE artifact is in the VLM's, renamed, with the
    same bytes (calibration on the text path included)."""
    text_src = _text_only(tiny_qwen3_vl[dtype], tmp_path / "text-src")
    arts = {}
    for label, root in (("vl", tiny_qwen3_vl[dtype]), ("text", text_src)):
        arts[label] = tmp_path / label
        res = cli("convert", root, arts[label], *args)
        assert res.exit_code == 0, res.stderr
    vl, text = _tensors(arts["vl"]), _tensors(arts["text"])
    renamed = {}
    for key, t in text.items():
        rel, _, name = key.partition("/")
        name = TEXT + name[len("model.") :] if name.startswith("model.") else name
        renamed[f"{rel}/{name}"] = t
    assert set(renamed) <= set(vl) and len(renamed) > 60
    for key, t in renamed.items():
        other = vl[key]
        assert t.dtype == other.dtype and t.shape == other.shape, key
        assert torch.equal(t.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), (
            key
        )
    assert {k for k in vl if k not in renamed} == {k for k in vl if "model.visual." in k}


# ---- bad input -------------------------------------------------------------------------------


def _raw(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


def test_unknown_text_family_refused(tiny_qwen3_vl: dict[str, Path]) -> None:
    raw = _raw(tiny_qwen3_vl["bf16"])
    dense = {**raw, "text_config": {**raw["text_config"], "model_type": "qwen3_vl_text"}}
    with pytest.raises(HetquantError, match=r"text_config model_type 'qwen3_vl_text' is not "):
        parse_config(dense)
    other = {**raw, "model_type": "llava_moe", "architectures": ["LlavaMoe"],
             "text_config": {**raw["text_config"], "model_type": "mixtral"}}  # fmt: skip
    with pytest.raises(HetquantError) as e:
        parse_config(other)
    assert "'llava_moe' is a vision-language model" in str(e.value)
    assert "'mixtral'" in str(e.value) and "\n" not in str(e.value)


def test_a_recipe_quantizing_the_vision_tower_refused(
    tiny_qwen3_vl: dict[str, Path], tmp_path: Path
) -> None:
    """A recipe whose rules would quantize the kept vision linears: one error naming the first
    vision module, before any output exists."""
    base = get_recipe("ascend-w8a8")
    bad = dataclasses.replace(
        base, name="vision-w8a8", rules={**base.rules, "kept": FORMATS["w8a8_dynamic"]}
    )
    out = tmp_path / "out"
    with pytest.raises(HetquantError) as e:
        convert(SourceCheckpoint.open(tiny_qwen3_vl["bf16"]), out, bad, max_shard_size=1 << 20)
    msg = str(e.value)
    assert msg.startswith("model.visual.") and "would quantize this vision module" in msg
    assert "w8a8_dynamic" in msg and not out.exists()


def test_fused_shape_disagreeing_with_config_refused(
    tiny_qwen3_vl: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in tiny_qwen3_vl["bf16"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    raw = _raw(src)
    raw["text_config"]["moe_intermediate_size"] = 256  # the stored experts are 512 wide
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HetquantError) as e:
        SourceCheckpoint.open(src)
    assert "model.language_model.layers.0.mlp.experts." in str(e.value)
    assert "disagrees with config.json" in str(e.value)


def test_bf16_source_stores_the_released_fused_layout(tiny_qwen3_vl: dict[str, Path]) -> None:
    root = tiny_qwen3_vl["bf16"]
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    name = f"{TEXT}layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(root / index[name]), "pt") as f:
        assert f.get_slice(name).get_shape() == [8, 256, 1024]  # [E, H, 2I]
