"""The Ascend 4-bit-expert recipes (ascend-w4a8, ascend-w4a16) end to end: what they store where,
the description and config keys msModelSlim writes for W4A8 models, Kimi K2 Thinking's INT4
experts kept as they are (w4a16) or refused (w4a8), and bad input through the CLI: exit 2, one
line naming the tensor and the legal values, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ascend_4bit_cases import BAD, _bf16_source, _refused
from support import INDEX, TINY, make_kimi_k2, read_json, st_bytes

from hetquant.convert import SourceCheckpoint

DESC = "quant_model_description.json"
W4A8_KEYS = {
    "quantize": "w8a8_dynamic",
    "moe_quantize": "w4a8_dynamic",
    "mla_quantize": "w8a8_dynamic",
}  # fmt: skip  msModelSlim deepseek_v3 adapter :557-563


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_kimi_k2(tmp_path_factory.mktemp("k2t") / "Kimi-K2-Thinking", "thinking")


def _ok(cli, src: Path, out: Path, *args: str) -> Path:
    res = cli("convert", src, out, *args)
    assert res.exit_code == 0, res.stderr
    return out


def _formats(root: Path) -> dict[str, dict]:
    return read_json(root / "hetquant.json")["module_formats"]


def test_w4a8_layout_description_and_config(cli, tmp_path: Path) -> None:
    root = _ok(cli, TINY, tmp_path / "o", "--recipe", "ascend-w4a8")
    fmts, desc, cfg = _formats(root), read_json(root / DESC), read_json(root / "config.json")
    e = "model.layers.1.mlp.experts.5"
    assert fmts[f"{e}.gate_proj"]["format"] == "w4a8_dynamic"
    assert fmts[f"{e}.gate_proj"]["params"] == {"bias_chunks": 1}
    assert fmts[f"{e}.down_proj"]["params"] == {"bias_chunks": 16}  # row-parallel: 16 chunks
    assert fmts["model.layers.3.mlp.experts.5.down_proj"]["format"] == "w8a8_dynamic"  # MTP layer
    assert fmts["model.layers.1.mlp.shared_experts.down_proj"]["format"] == "w8a8_dynamic"
    assert (desc["version"], desc["group_size"], desc["model_quant_type"]) == (
        "1.0.0",
        0,
        "W8A8_DYNAMIC",
    )
    keys = ("weight", "weight_scale", "weight_offset", "scale_bias")
    assert {k: desc[f"{e}.down_proj.{k}"] for k in keys} == dict.fromkeys(keys, "W4A8_DYNAMIC")
    # msModelSlim appends mtp_quantize, quantize, moe_quantize, mla_quantize, in that order
    assert list(cfg.items())[-4:] == [("mtp_quantize", "w8a8_dynamic"), *W4A8_KEYS.items()]
    assert "quantization_config" not in cfg


def test_w4a8_config_keys_without_mtp(cli, tmp_path: Path) -> None:
    """No MTP layer in the artifact (--mtp drop; Kimi K2): no mtp_quantize, as msModelSlim's
    kimi_k2 adapter (model_adapter.py:324, commented out)."""
    cfg = read_json(
        _ok(cli, TINY, tmp_path / "o", "--recipe", "ascend-w4a8", "--mtp", "drop") / "config.json"
    )
    assert cfg["num_nextn_predict_layers"] == 0
    assert "mtp_quantize" not in cfg and all(cfg[k] == v for k, v in W4A8_KEYS.items())


@pytest.mark.parametrize("group", [32, 128])
def test_w4a16_layout_and_description(cli, tmp_path: Path, group: int) -> None:
    root = _ok(cli, TINY, tmp_path / "o", "--recipe", "ascend-w4a16", "--group-size", str(group))
    fmts, desc, cfg = _formats(root), read_json(root / DESC), read_json(root / "config.json")
    for layer in (1, 3):  # the MTP layer's experts too
        f = fmts[f"model.layers.{layer}.mlp.experts.0.up_proj"]
        assert (f["format"], f["params"]["group_size"], f["params"]["shape_dtype"]) == (
            "ct_pack_quantized", group, "I32")  # fmt: skip
    assert fmts["model.layers.1.mlp.shared_experts.up_proj"]["format"] == "w8a8_dynamic"
    assert desc["group_size"] == group
    assert desc["model.layers.1.mlp.experts.0.up_proj.weight_packed"] == "W4A16"
    assert not set(W4A8_KEYS) & set(cfg)


def test_k2_thinking_w4a16_keeps_the_int4_codes(cli, thinking: Path, tmp_path: Path) -> None:
    out = _ok(cli, thinking, tmp_path / "o", "--recipe", "ascend-w4a16")
    src, index = SourceCheckpoint.open(thinking), read_json(out / INDEX)["weight_map"]
    experts = [n for n, t in src.tensors.items() if t.fmt_name == "ct_pack_quantized"]
    assert len(experts) == 2 * 12 * 3  # two MoE layers, 12 experts, gate/up/down
    for name in experts:
        prefix = name.removesuffix(".weight")
        for key, t in src.stored(name).items():
            got = st_bytes(out / index[f"{prefix}.{key}"], f"{prefix}.{key}")
            assert got == t.contiguous().view(torch.uint8).numpy().tobytes(), (prefix, key)
    assert read_json(out / DESC)["group_size"] == 32


def test_k2_thinking_other_group_needs_requantize(cli, thinking: Path, tmp_path: Path) -> None:
    _refused(cli, thinking, tmp_path / "o", ["--recipe", "ascend-w4a16", "--group-size", "128"],
             "model.layers.1.mlp.experts.0.gate_proj.weight", "group 32", "group 128",
             "--group-size 32", "--requantize")  # fmt: skip
    out = _ok(cli, thinking, tmp_path / "ok", "--recipe", "ascend-w4a16", "--group-size", "128",
              "--requantize")  # fmt: skip
    assert read_json(out / DESC)["group_size"] == 128


def test_k2_thinking_w4a8_cannot_hold_group_scales(cli, thinking: Path, tmp_path: Path) -> None:
    """One F32 scale per row cannot hold 32-wide groups of scales: the requantize policy."""
    _refused(cli, thinking, tmp_path / "o", ["--recipe", "ascend-w4a8"],
             "expert_gate (layer 1 expert 0)", "ct_pack_quantized", "w4a8_dynamic",
             "losing accuracy twice", "--requantize")  # fmt: skip
    _ok(cli, thinking, tmp_path / "ok", "--recipe", "ascend-w4a8", "--requantize")


@pytest.mark.parametrize(("changes", "args", "want"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_refused(cli, tmp_path: Path, changes: dict, args: list, want: list) -> None:
    src = _bf16_source(tmp_path / "src", **changes) if changes else TINY
    _refused(cli, src, tmp_path / "o", args, *want)


TYPE_OF = {
    "w8a8_dynamic": "W8A8_DYNAMIC",
    "w4a8_dynamic": "W4A8_DYNAMIC",
    "ct_pack_quantized": "W4A16",
}


@pytest.mark.parametrize("recipe", ["ascend-w4a8", "ascend-w4a16"])
def test_description_covers_exactly_the_root(cli, tmp_path: Path, recipe: str) -> None:
    root = _ok(cli, TINY, tmp_path / "o", "--recipe", recipe)
    desc, fmts = read_json(root / DESC), _formats(root)
    header = {"model_quant_type", "version", "metadata", "group_size", "optional"}
    index = read_json(root / INDEX)["weight_map"]
    assert set(desc) - header == set(index)
    for name in index:
        fmt = fmts.get(name.rpartition(".")[0], {}).get("format")
        assert desc[name] == TYPE_OF.get(fmt, "FLOAT"), name


@pytest.mark.parametrize("recipe", ["ascend-w4a8", "ascend-w4a16"])
def test_qwen3_moe(cli, tiny_qwen3: dict[str, Path], tmp_path: Path, recipe: str) -> None:
    """Qwen3-MoE converts too; msModelSlim's qwen3_moe adapter adds no W4A8 config keys."""
    root = _ok(cli, tiny_qwen3["fp8"], tmp_path / "o", "--recipe", recipe)
    assert not set(W4A8_KEYS) & set(read_json(root / "config.json"))
    fmts = _formats(root)
    routed = {f["format"] for m, f in fmts.items() if ".mlp.experts." in m}
    assert routed == {"w4a8_dynamic" if recipe == "ascend-w4a8" else "ct_pack_quantized"}
