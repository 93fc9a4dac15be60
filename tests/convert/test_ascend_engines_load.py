"""Every Ascend recipe's root part through ports of the Ascend engines' loading.

vllm-ascend (``vllm_ascend_port``, ``vllm_ascend_load``: description, per-module scheme, declared
parameters, TP weight loaders): ascend-w8a8, ascend-w4a8 and ascend-w4a16 load at TP 1, 2 and 4
with no problem, on DeepSeek-V3 and Kimi K2 (Thinking's INT4 experts kept as they are); the
ascend-hybrid root does not (its routed experts are in ``cpu_experts/``); and the port is able to
fail — each mutation of a good artifact is reported. SGLang-NPU (``sglang_npu_port``, routed
experts only): W8A8_DYNAMIC and W4A8_DYNAMIC experts load at MoE TP 1; it has no W4A16 MoE scheme,
and its W4A8 ``scale_bias`` loader fits MoE TP 1 only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sglang_npu_port import moe_report
from support import TINY, make_kimi_k2
from vllm_ascend_load import load_report

from hetquant.convert import SourceCheckpoint, convert, get_recipe

LOADABLE = ["ascend-w8a8", "ascend-w4a8", "ascend-w4a16"]


def _convert(src: Path, recipe: str, out: Path) -> Path:
    convert(SourceCheckpoint.open(src), out, get_recipe(recipe), max_shard_size=1 << 40)
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm-ascend")
    thinking = make_kimi_k2(base / "Kimi-K2-Thinking", "thinking")
    out = {r: _convert(TINY, r, base / r) for r in [*LOADABLE, "ascend-hybrid"]}
    out["k2-thinking-w4a16"] = _convert(thinking, "ascend-w4a16", base / "k2t")
    return out


def _scales_only(rounded: list[str]) -> bool:
    """vllm-ascend holds W8A8_DYNAMIC scales in the model dtype (BF16): F32 ones are rounded."""
    return all(n.endswith((".weight_scale", ".weight_offset")) for n in rounded)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("key", [*LOADABLE, "k2-thinking-w4a16"])
def test_ascend_recipe_loads_in_vllm_ascend(artifacts: dict[str, Path], key: str, tp: int) -> None:
    problems, rounded = load_report(artifacts[key], tp)
    assert problems == []
    assert _scales_only(rounded)
    experts = [n for n in rounded if ".mlp.experts." in n and "layers.3." not in n]
    if key != "ascend-w8a8":  # the 4-bit experts' scales load exactly (F32 / BF16 parameters)
        assert experts == []


def test_hybrid_root_is_not_a_vllm_ascend_model(artifacts: dict[str, Path]) -> None:
    """vllm-ascend builds every MoE layer as an NPU FusedMoE and looks its experts up: the
    hybrid's root part (experts in cpu_experts/, no CPU-expert mode) fails at construction."""
    problems, _ = load_report(artifacts["ascend-hybrid"])
    assert problems == [
        "model construction: KeyError: 'model.layers.1.mlp.experts.0.gate_proj.weight'"
    ]


def _mutated(src: Path, tmp: Path, desc=None, drop: str | None = None) -> Path:
    root = Path(shutil.copytree(src, tmp / "m"))
    path = root / "quant_model_description.json"
    doc = json.loads(path.read_text())
    if desc:
        desc(doc)
    path.write_text(json.dumps(doc))
    if drop:
        index = root / "model.safetensors.index.json"
        d = json.loads(index.read_text())
        d["weight_map"].pop(drop)
        index.write_text(json.dumps(d))
        _rewrite_without(root, drop)
    return root


def _rewrite_without(root: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    for f in root.glob("model-*.safetensors"):
        t = load_file(f)
        if name in t:
            t.pop(name)
            save_file(t, f)


EXPERT = "model.layers.1.mlp.experts.2"
MUTATIONS = [
    ("w4a8-no-version", "ascend-w4a8", lambda d: d.pop("version"), None,
     f"{EXPERT}.gate_proj.weight: AssertionError"),  # unpacked layout expected: twice the rows
    ("w4a8-no-group-size", "ascend-w4a8", lambda d: d.pop("group_size"), None,
     "w13_weight_scale_second"),  # per-group 256 assumed: its second scales never come
    ("w4a16-group-128", "ascend-w4a16", lambda d: d.update(group_size=128), None,
     f"{EXPERT}.gate_proj.weight_scale: AssertionError"),
    ("missing-entry", "ascend-w8a8", lambda d: d.pop("model.layers.0.self_attn.q_a_proj.weight"),
     None, "KeyError: 'model.layers.0.self_attn.q_a_proj.weight'"),
    ("mixed-fused-shards", "ascend-w8a8",
     lambda d: d.update({"model.layers.0.mlp.up_proj.weight": "FLOAT"}), None,
     "Not all shards of model.layers.0.mlp.gate_up_proj"),
    ("quantized-kv-b", "ascend-w8a8",
     lambda d: d.update({"model.layers.0.self_attn.kv_b_proj.weight": "W8A8_DYNAMIC"}), None,
     "kv_b_proj unquantized"),
    ("w4a16-shared-experts", "ascend-w4a16",
     lambda d: d.update({k: "W4A16" for k in list(d) if "shared_experts" in k}), None,
     "NotImplementedError: quant_type=W4A16 for layer_type=linear"),
    ("dropped-scale-bias", "ascend-w4a8", None, f"{EXPERT}.down_proj.scale_bias",
     "w2_scale_bias (2, 'w2'): declared, never loaded"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("recipe", "desc", "drop", "needle"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS]
)
def test_the_port_can_fail(
    artifacts: dict[str, Path], tmp_path: Path, recipe: str, desc, drop, needle: str
) -> None:
    root = _mutated(artifacts[recipe], tmp_path, desc, drop)
    problems, _ = load_report(root, 2)
    assert any(needle in p for p in problems), problems


def test_tp_beyond_the_packed_layout_is_refused(artifacts: dict[str, Path]) -> None:
    problems, _ = load_report(artifacts["ascend-w4a8"], 32)  # w4a8.py:366-367
    assert problems == ["model construction: ValueError: The current weight does not support "
                        "moe part tp>16."]  # fmt: skip


@pytest.mark.parametrize("key", ["ascend-w8a8", "ascend-w4a8"])
def test_sglang_npu_loads_w8a8_and_w4a8_experts(artifacts: dict[str, Path], key: str) -> None:
    assert moe_report(artifacts[key], 1) == []


def test_sglang_npu_w4a8_scale_bias_needs_moe_tp_1(artifacts: dict[str, Path]) -> None:
    """SGLang loads w2_scale_bias [E, H, 16/tp] as a per-channel w2 scale: copied whole, so the
    [H, 16] msModelSlim writes (and we do) fits only at MoE TP 1 (EP or TP 1 for the experts)."""
    problems = moe_report(artifacts["ascend-w4a8"], 2)
    assert problems and all("scale_bias" in p for p in problems)
    assert (
        "down_proj.scale_bias: AssertionError: expert_data [256, 8] != loaded_weight [256, 16]"
        in (problems[0])
    )


@pytest.mark.parametrize(
    ("key", "needle"),
    [("ascend-w4a16", "Unsupported ModelSlim MoE schemes for layer model.layers.1.mlp.experts: "
                      "W13='W4A16', W2='W4A16'"),
     ("ascend-hybrid", "Missing ModelSlim MoE quantization description for layer "
                       "model.layers.1.mlp.experts")],
)  # fmt: skip
def test_sglang_npu_refuses(artifacts: dict[str, Path], key: str, needle: str) -> None:
    assert moe_report(artifacts[key]) == [f"model construction: ValueError: {needle}"]


@pytest.mark.parametrize("key", [*LOADABLE, "ascend-hybrid"])
def test_transformers_does_not_read_ascend_artifacts(artifacts: dict[str, Path], key: str) -> None:
    """No quantization_config: transformers builds a BF16 DeepseekV3 and finds the scales
    unexpected, packed experts mismatched (refused) or missing (reinitialised at random)."""
    import torch
    import transformers

    try:
        _, info = transformers.AutoModelForCausalLM.from_pretrained(
            artifacts[key], dtype=torch.bfloat16, output_loading_info=True
        )
    except RuntimeError as e:  # the W4A8 experts' [n/2, k] codes against [n, k] weights
        assert key == "ascend-w4a8" and "ignore_mismatched_sizes" in str(e)
        return
    assert any(k.endswith(".weight_scale") for k in info["unexpected_keys"])
    if key != "ascend-w8a8":  # w4a16 (weight_packed) and the hybrid (cpu_experts/): absent
        assert any(".mlp.experts" in k for k in info["missing_keys"]), info["missing_keys"]
