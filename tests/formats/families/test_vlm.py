"""The VLM seam (``formats/families/vlm.py``) on config.json alone: the Qwen3-VL-MoE and Kimi K2.5
configs parse through their text families, the role tables are the text families' renamed plus
the vision tower, and bad configs are refused with one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetquant.formats import HetquantError
from hetquant.formats.families import get_family, parse_config
from hetquant.formats.families.vlm import VISION, VlmFamily

LAYOUTS = Path(__file__).resolve().parents[3] / "examples" / "vlm-layout"


def _raw(model: str) -> dict:
    return json.loads((LAYOUTS / f"{model}.config.json").read_text())


def test_qwen3_vl_235b_parses_as_qwen3_moe_under_a_prefix() -> None:
    cfg = parse_config(_raw("Qwen3-VL-235B-A22B"))
    text = get_family("qwen3_moe")
    assert cfg.family_name == "qwen3_vl_moe" and isinstance(cfg.family, VlmFamily)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts) == (4096, 94, 128)
    assert cfg.norm_topk_prob and cfg.decoder_raw["rope_theta"] == 5000000
    assert "rope_scaling" not in cfg.decoder_raw  # text-only mrope is 1-D rope
    assert cfg.raw["model_type"] == "qwen3_vl_moe"  # the artifact's config.json stays the VLM's
    fam = cfg.family
    assert fam.tensor("q", 3) == "model.language_model.layers.3.self_attn.q_proj.weight"
    assert fam.tensor("embed") == "model.language_model.embed_tokens.weight"
    assert fam.tensor("lm_head") == "lm_head.weight"
    assert [r.name for r in fam.roles] == [r.name for r in text.roles]
    assert fam.awq is text.awq and fam.fused_experts == text.fused_experts
    names = fam.expected_tensors(cfg)
    vision = {n: t for n, t in names.items() if t.role.scope == VISION}
    assert len(vision) == 3 + 27 * 12 + 6 + 3 * 6
    quantizable = {n for n, t in vision.items() if not t.role.kept}  # msModelSlim's W8A8 set
    assert quantizable == {f"model.visual.blocks.{b}.{m}.weight" for b in range(27)
                           for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1")}  # fmt: skip
    assert vision["model.visual.deepstack_merger_list.2.linear_fc2.weight"].shape == (4096, 4608)
    assert names["model.visual.patch_embed.proj.weight"].shape == (1152, 3, 2, 16, 16)
    loc = fam.locate("model.visual.blocks.26.attn.qkv")
    assert loc is not None and loc.role.name == "vision:model.visual.blocks.attn.qkv.weight"
    assert fam.locate("model.layers.0.self_attn.q_proj") is None  # the text family's own names


def test_qwen3_vl_text_config_variants() -> None:
    raw = _raw("Qwen3-VL-30B-A3B")
    text = raw["text_config"]
    saved = {**raw, "text_config": {  # transformers 5.24's save_pretrained spelling
        **{k: v for k, v in text.items() if k not in ("num_experts", "rope_scaling", "rope_theta")},
        "num_local_experts": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]},
    }}  # fmt: skip
    cfg = parse_config(saved)
    assert cfg.num_experts == 128 and cfg.decoder_raw["rope_theta"] == 5e6
    yarn = {**raw, "text_config": {**text, "rope_scaling": {"rope_type": "yarn", "factor": 4}}}
    with pytest.raises(HetquantError, match=r"text_config rope_type 'yarn'"):
        parse_config(yarn)
    with pytest.raises(HetquantError, match=r"vision_config: field depth is missing"):
        parse_config({**raw, "vision_config": {k: v for k, v in raw["vision_config"].items()
                                               if k != "depth"}})  # fmt: skip
    with pytest.raises(HetquantError, match=r"text_config is not an object"):
        parse_config({**raw, "text_config": [1]})


def test_kimi_k25_parses_as_deepseek_v3_under_a_prefix() -> None:
    raw = _raw("Kimi-K2.5")
    cfg = parse_config(raw)
    assert cfg.family_name == "kimi_k25" and cfg.num_experts == 384
    assert cfg.quantization_config["quant_method"] == "compressed-tensors"  # the top-level one
    fam = cfg.family
    assert fam.tensor("kv_b", 5) == "language_model.model.layers.5.self_attn.kv_b_proj.weight"
    assert fam.tensor("lm_head") == "language_model.lm_head.weight"
    names = fam.expected_tensors(cfg)
    assert names["mm_projector.proj.2.weight"].shape == (7168, 4608)
    assert names["vision_tower.patch_embed.pos_emb.weight"].shape == (64, 64, 1152)
    assert names["vision_tower.encoder.blocks.26.wqkv.weight"].shape == (3456, 1152)
    quantizable = {n for n, t in names.items() if t.role.scope == "vision" and not t.role.kept}
    assert quantizable == {
        f"vision_tower.encoder.blocks.{b}.mlp.{fc}.weight"
        for b in range(27)
        for fc in ("fc0", "fc1")
    }  # fmt: skip  (msModelSlim's K2.5 W4A8 set)
    inner = {**raw, "text_config": {**raw["text_config"], "quantization_config":
                                    raw["quantization_config"]}}  # fmt: skip
    del inner["quantization_config"]
    assert parse_config(inner).quantization_config == cfg.quantization_config  # in text_config
    new = {**raw, "vision_config": {"patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64,
           "num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304}}  # fmt: skip
    assert parse_config(new).family.expected_tensors(parse_config(new)).keys() == names.keys()
    bad = {**raw, "vision_config": {**raw["vision_config"], "merge_kernel_size": [2]}}
    with pytest.raises(HetquantError, match=r"merge_kernel_size \[2\]: expected \[kh, kw\]"):
        parse_config(bad)
