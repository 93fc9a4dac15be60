"""A compressed-tensors ``quantization_config`` from an untrusted config.json (issue #25 §3):
wrong-typed targets / ignore lists, formats and invalid ``re:`` patterns are one-line errors
naming the field, not tracebacks when a module is matched."""

from __future__ import annotations

import pytest

from hetquant.formats import HetquantError
from hetquant.formats.ct_scheme import CtQuantConfig


def _qc(**group: object) -> dict:
    g = {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 32}}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {**g, **group}}}


def test_a_valid_config_matches() -> None:
    qc = CtQuantConfig.parse({**_qc(targets=["re:.*experts.*"]), "ignore": ["lm_head"]})
    assert qc.scheme_for("model.layers.1.mlp.experts.0.up_proj", "linear", True) is not None
    assert qc.scheme_for("lm_head", "head", False) is None


@pytest.mark.parametrize(
    ("qc", "field", "expected"),
    [
        ({**_qc(), "ignore": "lm_head"}, "quantization_config.ignore", "a list of strings"),
        ({**_qc(), "ignore": [1]}, "quantization_config.ignore", "a list of strings"),
        ({**_qc(), "ignore": 7}, "quantization_config.ignore", "a list of strings"),
        ({**_qc(), "ignore": ["re:(unclosed"]}, "quantization_config.ignore", "a valid regular"),
        (_qc(targets="Linear"), "quantization_config.config_groups.group_0.targets", "a list"),
        (_qc(targets=[None]), "quantization_config.config_groups.group_0.targets", "a list"),
        (_qc(targets=["re:*"]), "quantization_config.config_groups.group_0.targets", "a valid"),
        (_qc(format=4), "quantization_config.config_groups.group_0.format", "a string"),
        ({**_qc(), "format": ["pack-quantized"]}, "quantization_config.format", "a string"),
    ],
)
def test_wrong_typed_fields_are_refused(qc: dict, field: str, expected: str) -> None:
    with pytest.raises(HetquantError, match=f"c.json: field {field} must be {expected}"):
        CtQuantConfig.parse(qc, "c.json")
