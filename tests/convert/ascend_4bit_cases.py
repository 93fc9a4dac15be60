"""Shared by tests/convert/recipes/test_ascend_4bit.py and engine/test_ascend_4bit_calibration.py
(this folder is on ``sys.path``: ``conftest.py``): the ascend-w4a8 / ascend-w4a16 bad-input cases,
the random BF16 source they use, and the one-line refusal check."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from support import INDEX, TINY, read_json

from hetquant.formats.families import ModelConfig, expected_tensors

__all__ = ["BAD", "_bf16_source", "_refused"]


def _refused(cli, src: Path, out: Path, args: list[str], *want: str) -> str:
    res = cli("convert", src, out, *args)
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for w in want:
        assert w in res.stderr, res.stderr
    assert not out.exists()  # nothing written
    return res.stderr


def _bf16_source(out: Path, **changes: int) -> Path:
    """A random BF16 DeepSeek-V3 checkpoint of the tiny config with ``changes`` (no MTP)."""
    raw = read_json(TINY / "config.json")
    raw.pop("quantization_config")
    raw.update(num_nextn_predict_layers=0, **changes)
    gen, tensors = torch.Generator().manual_seed(0), {}
    for name, role in expected_tensors(ModelConfig.from_dict(raw)).items():
        x = torch.randn(role.shape, generator=gen) / math.sqrt(role.shape[-1])
        tensors[name] = x if role.role.kind == "bias" else x.bfloat16()
    out.mkdir()
    save_file(tensors, out / "model-00001-of-000001.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-000001.safetensors")
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(raw))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, out / f)
    return out


BAD = [
    ("w4a16-group-64", {}, ["--recipe", "ascend-w4a16", "--group-size", "64"],
     ["recipe ascend-w4a16", "group_size=64", "one of 32, 128"]),
    ("w4a8-any-group", {}, ["--recipe", "ascend-w4a8", "--group-size", "32"],
     ["recipe ascend-w4a8 has no option 'group_size'"]),
    ("w4a16-in-not-in-groups", {"moe_intermediate_size": 200}, ["--recipe", "ascend-w4a16"],
     ["model.layers.1.mlp.experts.0.down_proj.weight", "in=200", "group_size 32"]),
    ("w4a16-in-not-in-groups-128", {"hidden_size": 320}, ["--recipe", "ascend-w4a16", "--group-size", "128"],
     ["model.layers.1.mlp.experts.0.gate_proj.weight", "in=320", "group_size 128"]),
    ("w4a8-in-not-16", {"moe_intermediate_size": 200}, ["--recipe", "ascend-w4a8"],
     ["model.layers.1.mlp.experts.0.down_proj.weight", "in=200", "in must be a multiple of 16"]),
    ("w4a8-odd-out", {"hidden_size": 251}, ["--recipe", "ascend-w4a8"],
     ["model.layers.1.mlp.experts.0.down_proj.weight", "out=251", "out must be even"]),
]  # fmt: skip
