"""The saved calibration result (``calib/result.py``): a synthetic result round-trips through
``save`` / ``load`` bit-exactly and lazily, refusals name the fix, and a result saved before
targets were recorded loads its one format as every linear's target."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hetquant.calib import AwqOptions, CalibrationResult, Transform, calibrate, quantizer_for
from hetquant.calib.result import RESULT_JSON, StoredTransforms
from hetquant.formats import HetquantError

NAMES = ("model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.o_proj.weight")


def _synthetic() -> CalibrationResult:
    g = torch.Generator().manual_seed(0)
    tfs = {
        NAMES[0]: Transform(
            col_mul=torch.rand(64, generator=g) + 0.5,
            shrink=torch.tensor([[1], [0], [3], [2]], dtype=torch.uint8),
        ),
        NAMES[1]: Transform(row_div=torch.rand(4, generator=g) + 0.5),
        "model.layers.3.input_layernorm.weight": Transform(row_div=torch.full((64,), 2.0)),
    }
    return CalibrationResult(AwqOptions(group_size=64), tfs, NAMES, {"tokens": {"n": 3}})


def test_saved_result_round_trips_lazily(tmp_path) -> None:
    a = _synthetic()
    root = a.save(tmp_path / "calib")
    assert sorted(p.name for p in root.iterdir()) == [
        RESULT_JSON,
        "layer_000.safetensors",
        "layer_003.safetensors",
    ]
    loaded = CalibrationResult.load(root)
    assert isinstance(loaded.transforms, StoredTransforms)
    assert loaded.options == a.options and loaded.stats == a.stats
    assert loaded.quantized == NAMES and loaded.changed == a.changed
    for name, t in a.transforms.items():
        got = loaded.transforms[name].tensors()
        assert got.keys() == t.tensors().keys()
        assert all(torch.equal(got[k], v) for k, v in t.tensors().items())
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    for name in NAMES:
        assert torch.equal(loaded.apply(name, w), a.apply(name, w))
        assert loaded.quantizer(name) == a.quantizer(name)


def test_refusals_name_the_fix(tmp_path) -> None:
    with pytest.raises(
        HetquantError, match=r"no calibration\.json; not a \(complete\) calibration"
    ):
        CalibrationResult.load(tmp_path)
    root = _synthetic().save(tmp_path / "calib")
    doc = json.loads((root / RESULT_JSON).read_text())
    (root / RESULT_JSON).write_text(json.dumps(doc | {"version": 99}))
    with pytest.raises(HetquantError, match="not a hetquant-awq-calibration v1"):
        CalibrationResult.load(root)
    a = _synthetic()
    with pytest.raises(HetquantError, match="needs weights_fn"):
        a.weight(NAMES[0])
    targets = {NAMES[0]: quantizer_for("awq_w4a16", {"group_size": 64})}
    with pytest.raises(HetquantError, match="not a calibrated linear"):
        dataclasses.replace(a, targets=targets).quantizer(NAMES[1])


def test_result_saved_with_one_quantizer_option_loads_its_targets(
    tiny_source, calib_tokens, tmp_path
):
    """A result saved before targets were recorded named one format in its options
    (``quantizer``, ct-w4a16's); loaded, every calibrated linear has that format as target."""
    import json

    a = calibrate(tiny_source, calib_tokens[:2, :32], AwqOptions(method="rtn"), device="cpu")
    root = a.save(tmp_path / "calib")
    doc = json.loads((root / "calibration.json").read_text())
    del doc["targets"]
    doc["options"].update(quantizer="ct_pack_quantized", group_size=32)
    (root / "calibration.json").write_text(json.dumps(doc))
    loaded = CalibrationResult.load(root)
    assert loaded.options == dataclasses.replace(a.options, group_size=32)
    ct = quantizer_for("ct_pack_quantized", {"group_size": 32})
    assert loaded.quantized == a.quantized and a.quantized
    assert all(loaded.quantizer(n) == ct for n in a.quantized)
