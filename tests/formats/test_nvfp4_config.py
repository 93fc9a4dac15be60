"""formats/nvfp4_config.py: ModelOpt's hf_quant_config.json and config.json's quantization_config
for the weight-only and W4A4 variants."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from hetquant.formats import HetquantError, nvfp4
from hetquant.formats.nvfp4_config import hf_quant_config


def test_hf_quant_config() -> None:
    hf, qc = hf_quant_config(["model.layers.*.self_attn*", "lm_head", "lm_head"])
    assert hf["producer"]["name"] == "hetquant"
    assert hf["quantization"] == {
        "quant_algo": "W4A16_NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.layers.*.self_attn*"],
    }
    assert qc == {"quant_method": "modelopt", **hf}
    qc["quantization"]["exclude_modules"].append("x")  # independent copies
    assert "x" not in hf["quantization"]["exclude_modules"]
    w4a4, _ = hf_quant_config([], with_input_scale=True, kv_cache_quant_algo="FP8")
    assert w4a4["quantization"]["quant_algo"] == "NVFP4"
    assert w4a4["quantization"]["kv_cache_quant_algo"] == "FP8"
    json.dumps(hf)
    with pytest.raises(HetquantError, match="not a str"):
        hf_quant_config("lm_head")


def test_producer_version_is_the_installed_hetquant() -> None:
    hf, _ = hf_quant_config([])
    assert hf["producer"]["version"] == importlib.metadata.version("hetquant")
    assert nvfp4.hf_quant_config is hf_quant_config
