"""NVFP4 merged modules share one ``weight_scale_2`` (issue #14 item 4): the plan groups the
linears engines merge, the converter quantizes them against their joint absmax, and the bytes
equal ModelOpt's own export (golden digests recorded by ``benchmarks/modelopt_nvfp4.py``
with nvidia-modelopt 0.47.0)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file
from support import REPO, TINY

from hetquant.convert import SourceCheckpoint, convert, get_recipe, plan_for
from hetquant.convert.recipes.quantized import FP4, KEEP, RuleRecipe
from hetquant.formats.nvfp4 import E2M1_MAX, FP8_E4M3_MAX
from hetquant.formats.nvfp4_ascend import to_canonical

GOLDEN = json.loads((REPO / "tests" / "convert" / "golden_modelopt_nvfp4.json").read_text())
KEYS = ("weight", "weight_scale", "weight_scale_2")


@pytest.fixture(scope="module")
def source() -> SourceCheckpoint:
    return SourceCheckpoint.open(TINY)


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, source: SourceCheckpoint) -> dict:
    """{layout: every tensor of the fp4 artifact in that layout}."""
    out = {}
    for layout in ("nvfp4", "ascend"):
        root = tmp_path_factory.mktemp(layout) / "art"
        recipe = get_recipe("fp4").with_options({"fp4_layout": layout})
        convert(source, root, recipe, max_shard_size=1 << 40)
        out[layout] = {k: v for f in root.glob("model-*") for k, v in load_file(f).items()}
    return out


def _modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n.removesuffix(".weight_scale_2") for n in tensors if n.endswith("_scale_2"))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(tensors: dict[str, torch.Tensor], module: str) -> str:
    return hashlib.sha256(b"".join(_bytes(tensors[f"{module}.{k}"]) for k in KEYS)).hexdigest()


def test_bytes_equal_modelopt_export(stored: dict) -> None:
    tensors = stored["nvfp4"]
    assert _modules(tensors) == sorted(GOLDEN["modules"])
    differ = [m for m, want in GOLDEN["modules"].items() if _digest(tensors, m) != want]
    assert differ == []


def test_pairs_share_the_joint_scale(stored: dict, source: SourceCheckpoint) -> None:
    """gate and up of every dense MLP, shared expert and routed expert (MTP layer included):
    one weight_scale_2 = max(amax_gate, amax_up) / (6 · 448); down keeps its own."""
    tensors = stored["nvfp4"]
    gates = [m for m in _modules(tensors) if m.endswith("gate_proj")]
    assert len(gates) == 28  # 1 dense + 3 MoE layers x (1 shared + 8 routed)
    for gate in gates:
        up, down = gate.replace("gate_proj", "up_proj"), gate.replace("gate_proj", "down_proj")
        amax = max(float(source.dequantized(f"{m}.weight").abs().amax()) for m in (gate, up))
        want = torch.tensor(amax, dtype=torch.float32) / (E2M1_MAX * FP8_E4M3_MAX)
        for m in (gate, up):
            assert torch.equal(tensors[f"{m}.weight_scale_2"], want), m
        own = float(source.dequantized(f"{down}.weight").abs().amax())
        assert float(tensors[f"{down}.weight_scale_2"]) == pytest.approx(own / 2688, rel=1e-6)


def test_ascend_layout_follows_the_same_rule(stored: dict) -> None:
    canonical, tiled = stored["nvfp4"], stored["ascend"]
    for m in _modules(tiled):
        got = to_canonical({k: tiled[f"{m}.{k}"] for k in KEYS})
        for k in KEYS:
            assert _bytes(got[k]) == _bytes(canonical[f"{m}.{k}"]), (m, k)


def test_plan_groups_by_merged_module(source: SourceCheckpoint) -> None:
    plan = plan_for(source, get_recipe("fp4"), 1 << 40)
    groups = {j.source: j.amax_group for j in plan.jobs}
    e3 = "model.layers.2.mlp.experts.3."
    assert groups[e3 + "gate_proj.weight"] == (e3 + "gate_proj.weight", e3 + "up_proj.weight")
    assert groups[e3 + "up_proj.weight"] == groups[e3 + "gate_proj.weight"]
    assert groups[e3 + "down_proj.weight"] == ()
    assert groups["model.layers.0.mlp.gate_proj.weight"][1] == "model.layers.0.mlp.up_proj.weight"
    members = {n for g in groups.values() for n in g}
    assert all(".mlp." in n and "down_proj" not in n for n in members)
    assert len(members) == 56


def test_attention_merge_from_the_role_table(source: SourceCheckpoint) -> None:
    """DeepSeek's q_a and kv_a (vLLM's fused_qkv_a_proj) group when both go to NVFP4."""
    rules = {c: FP4 for c in ("attention", "absorbed", "dense", "shared", "routed")}
    rules |= {c: KEEP for c in ("kept", "router", "embedding", "norm", "mtp_extra")}
    recipe = RuleRecipe("t", "", rules=rules, choices={"mtp": ("keep",), "requantize": (False,),
                                                       "fp4_layout": ("nvfp4",)})  # fmt: skip
    groups = {j.source: j.amax_group for j in plan_for(source, recipe, 1 << 40).jobs}
    a = "model.layers.1.self_attn."
    assert groups[a + "q_a_proj.weight"] == (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight")
    assert groups[a + "q_b_proj.weight"] == groups[a + "o_proj.weight"] == ()


def test_formats_without_a_per_tensor_scale_do_not_group(source: SourceCheckpoint) -> None:
    for recipe in ("awq-w4a16", "ascend-w8a8", "bf16"):
        assert all(j.amax_group == () for j in plan_for(source, get_recipe(recipe), 1 << 40).jobs)
