"""Tests of formats/ascend_description.py: quant_model_description.json entries and header
against msModelSlim's ascendV1 saver, and refused formats / types."""

from __future__ import annotations

import pytest

from hetquant.formats import HetquantError
from hetquant.formats import ascend_description as desc


def test_description_entries_golden() -> None:
    p = "model.layers.3.mlp.experts.7.down_proj"
    assert desc.description_entries(p, "w8a8_dynamic") == {
        f"{p}.weight": "W8A8_DYNAMIC",
        f"{p}.weight_scale": "W8A8_DYNAMIC",
        f"{p}.weight_offset": "W8A8_DYNAMIC",
    }
    q = "model.layers.0.self_attn.q_a_proj"
    assert desc.description_entries(q, "w8a8") == {
        f"{q}.{name}": "W8A8"
        for name in (
            "weight",
            "weight_scale",
            "weight_offset",
            "input_scale",
            "input_offset",
            "deq_scale",
            "quant_bias",
        )
    }
    r = "model.layers.0.self_attn.kv_b_proj"
    assert desc.description_entries(r, "bf16") == {f"{r}.weight": "FLOAT"}
    header = desc.description_header()  # msModelSlim's ascendv1.py:209-227, in its order
    assert list(header.items()) == [
        ("version", "1.0.0"),
        ("model_quant_type", "W8A8_DYNAMIC"),
        ("metadata", {}),
        ("group_size", 0),
        ("optional", {}),
    ]
    assert desc.description_header("W8A8")["model_quant_type"] == "W8A8"


def test_unknown_format_or_type_refused() -> None:
    with pytest.raises(HetquantError, match="fp8_block"):
        desc.description_entries("model.layers.0.mlp.up_proj", "fp8_block")
    with pytest.raises(HetquantError, match="W4A8"):
        desc.description_header("W4A8")
