"""The deepseek_v4 families: config parsing (DeepSeek's keys and transformers'), the role tables
against what transformers 5.24 itself saves, MTP naming, and one-line refusals."""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest

from hetquant.formats import HetquantError
from hetquant.formats.families import expected_tensors, parse_config
from hetquant.formats.families.bounds import expected_count

GEN = runpy.run_path(str(Path(__file__).parents[3] / "examples/tiny-deepseek-v4/make_tiny.py"))
NATIVE = GEN["deepseek_config"]()


def test_native_config_parses_every_layer_type() -> None:
    cfg = parse_config(copy.deepcopy(NATIVE))
    assert cfg.family.name == "deepseek_v4"
    assert cfg.attention == ("swa", "csa", "hca", "csa") and cfg.mlp == (
        "hash",
        "topk",
        "topk",
        "topk",
    )
    assert (
        cfg.num_mtp_layers == 1
        and cfg.expert_dtype == "fp4"
        and cfg.weight_block_size == (128, 128)
    )
    assert cfg.layer_scopes(4) == {"layer", "swa", "topk", "shared"}  # the MTP block


def test_transformers_layout_matches_save_pretrained() -> None:
    """Every name and shape transformers 5.24 saves for the tiny model is what the
    deepseek_v4_hf table expects, and nothing else (the model is built on the meta device)."""
    import torch
    from transformers import DeepseekV4ForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    hf_cfg = GEN["hf_config"]()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf_cfg)
    saved = {
        k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()
    }
    cfg = parse_config(hf_cfg.to_dict())
    assert cfg.family.name == "deepseek_v4_hf" and cfg.num_mtp_layers == 0
    assert {k: t.shape for k, t in expected_tensors(cfg).items()} == saved


def test_native_names_are_transformers_names_inverted() -> None:
    """DeepSeek's names = to_deepseek(transformers' names) for the main layers, and the MTP
    layer lives under mtp.0. with the main layers' prefix nowhere."""
    cfg = parse_config(copy.deepcopy(NATIVE))
    names = set(expected_tensors(cfg))
    hf = parse_config({**GEN["hf_config"]().to_dict()})
    assert {GEN["to_deepseek"](n) for n in expected_tensors(hf)} == {
        n for n in names if not n.startswith("mtp.")
    }
    mtp = sorted(n for n in names if n.startswith("mtp.0."))
    assert "mtp.0.e_proj.weight" in mtp and "mtp.0.ffn.experts.7.w2.weight" in mtp
    assert "mtp.0.attn.compressor.wkv.weight" not in mtp  # the MTP block is sliding attention
    assert not any(n.startswith("layers.4.") for n in names)
    assert expected_count(cfg) == len(names)
    loc = cfg.family.locate("mtp.0.ffn.experts.3.w1")
    assert (loc.layer, loc.expert, loc.role.name) == (4, 3, "expert_gate")
    hc = cfg.family.locate("layers.2")  # hc_attn_fn sits directly under the layer
    assert hc is not None and hc.layer == 2


def test_v41_expert_dtype_in_quantization_config() -> None:
    raw = copy.deepcopy(NATIVE)
    raw["quantization_config"]["expert_dtype"] = raw.pop("expert_dtype")
    assert parse_config(raw).expert_dtype == "fp4"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r.update(expert_dtype="int4"), r"field expert_dtype must be one of fp4, fp8, got 'int4'"),
        (lambda r: r["quantization_config"].update(expert_dtype="fp8"),
         r"expert_dtype 'fp4' and quantization_config.expert_dtype 'fp8' disagree"),
        (lambda r: (r.pop("expert_dtype"), r["quantization_config"].update(expert_dtype="nvfp4")),
         r"field quantization_config.expert_dtype must be one of fp4, fp8"),
        (lambda r: r["quantization_config"].update(scale_fmt="e4m3"),
         r"field quantization_config.scale_fmt must be ue8m0"),
        (lambda r: r.update(compress_ratios=[0, 4, 16, 4]),
         r"compress_ratios\[2\] = 16 is no DeepSeek-V4 attention type"),
        (lambda r: (r.pop("compress_ratios"), r.update(layer_types=["sliding_attention",
          "linear_attention", "sliding_attention", "sliding_attention"])),
         r"layer_types\[1\] = 'linear_attention' is a layer type hetquant does not know"),
        (lambda r: r.update(mlp_layer_types=["moe", "dense", "moe", "moe"]),
         r"mlp_layer_types\[1\] = 'dense' is a layer type hetquant does not know"),
        (lambda r: r.pop("compress_ratios"), r"neither compress_ratios .* nor layer_types"),
        (lambda r: r.update(model_type="deepseek_v41"), r"model_type 'deepseek_v41': DeepSeek-V4.1"),
        (lambda r: r.update(o_groups=3), r"num_attention_heads 4 is not a multiple of o_groups 3"),
    ],
)  # fmt: skip
def test_bad_config_is_one_line_naming_it(edit, match: str) -> None:
    raw = copy.deepcopy(NATIVE)
    edit(raw)
    with pytest.raises(HetquantError, match=match) as e:
        parse_config(raw)
    assert "\n" not in str(e.value)


def test_mtp_drop_config() -> None:
    cfg = parse_config(type(parse_config(copy.deepcopy(NATIVE))).without_mtp(copy.deepcopy(NATIVE)))
    assert cfg.num_mtp_layers == 0 and not any(n.startswith("mtp.") for n in expected_tensors(cfg))
