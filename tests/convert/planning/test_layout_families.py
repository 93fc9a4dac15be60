"""The real-size layouts of Kimi K2 (Instruct FP8, Thinking INT4 experts) and DeepSeek-V3.2 read
from headers only, with the real models' sizes, and plan like the real things."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hetquant.convert import SourceCheckpoint, get_recipe, plan_for, precision_table
from hetquant.formats import HetquantError, get_format, safetensors_io

REPO = Path(__file__).resolve().parents[3]
LAYOUT = REPO / "examples" / "deepseek-v3-layout"
K2_PARAMS = 1_026_408_232_448  # 61 layers (1 dense), 384 experts, vocab 163,840: "1.04T" cards
K2_ROUTED = 384 * 3 * 7168 * 2048 * 60
V32_INDEXER = 61 * (64 * 128 * 1536 + 128 * 7168 + 2 * 128 + 64 * 7168)  # the MTP one in "mtp"


def _write(name: str, config: str, shards: int, tmp: Path) -> SourceCheckpoint:
    spec = importlib.util.spec_from_file_location("make_layout", LAYOUT / "make_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return SourceCheckpoint.open(mod.write_layout(tmp / name, LAYOUT / config, shards))


@pytest.fixture(scope="module")
def k2(tmp_path_factory: pytest.TempPathFactory) -> SourceCheckpoint:
    return _write("Kimi-K2-Instruct", "config_kimi_k2.json", 62, tmp_path_factory.mktemp("k2"))


@pytest.fixture(scope="module")
def k2t(tmp_path_factory: pytest.TempPathFactory) -> SourceCheckpoint:
    tmp = tmp_path_factory.mktemp("k2t")
    return _write("Kimi-K2-Thinking", "config_kimi_k2_thinking.json", 62, tmp)


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> SourceCheckpoint:
    return _write("DeepSeek-V3.2", "config_deepseek_v32.json", 163, tmp_path_factory.mktemp("v32"))


@pytest.fixture
def headers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_data(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("planning touched tensor data")

    monkeypatch.setattr(safetensors_io.MappedFile, "__init__", no_data)


def test_k2_layout(k2: SourceCheckpoint) -> None:
    cfg = k2.config
    assert (cfg.raw["model_type"], cfg.family.name, cfg.num_mtp_layers) == (
        "kimi_k2",
        "deepseek_v3",
        0,
    )
    assert len(k2.shard_files) == 62 and k2.shard_files[-1] == "model-00062-of-000062.safetensors"
    assert not any(n.startswith("model.layers.61.") for n in k2.tensors)
    assert cfg.moe_layers == tuple(range(1, 61))
    assert 1.028e12 < k2.total_bytes < 1.030e12  # FP8 + scales + BF16 embeddings


def test_k2_thinking_layout_is_ct_int4_experts(k2t: SourceCheckpoint) -> None:
    ct = get_format("ct_pack_quantized", group_size=32, shape_dtype="I32")
    fmts = {t.fmt for n, t in k2t.tensors.items() if ".mlp.experts." in n}
    assert fmts == {ct}
    assert {t.fmt_name for n, t in k2t.tensors.items() if ".mlp.experts." not in n} == {
        "bf16",
        "plain",
    }
    assert 590e9 < k2t.total_bytes < 600e9  # "~600 GB" (reference/model_families.md §1.4)


@pytest.mark.parametrize(
    ("model", "recipe"),
    [("k2", "ascend-hybrid"), ("k2", "awq-w4a16"), ("k2t", "ascend-hybrid"), ("k2t", "bf16"),
     ("v32", "ascend-hybrid"), ("v32", "fp4")],
)  # fmt: skip
def test_plans_read_headers_only(request, headers_only, model: str, recipe: str) -> None:
    src: SourceCheckpoint = request.getfixturevalue(model)
    plan = plan_for(src, get_recipe(recipe), 5 * 10**9)
    table = precision_table(plan)
    groups = {g["name"]: g for g in table["groups"]}
    if model != "v32":
        assert table["params"] == K2_PARAMS
        assert groups["routed_experts"]["params"] == K2_ROUTED
    if (model, recipe) == ("k2t", "ascend-hybrid"):  # lossless group-wise CPU experts
        assert groups["routed_experts"]["format"] == "int4_cpu_group_experts"
        assert groups["routed_experts"]["bits_per_weight"] == 4.5  # 4 + 16 / 32
    if model == "v32":
        assert groups["indexer"]["params"] == V32_INDEXER
        assert set(groups["indexer"]["format"].lower().split("+")) <= {"bf16"}


def test_k2_thinking_refuses_requantizing_awq(k2t: SourceCheckpoint, headers_only) -> None:
    with pytest.raises(HetquantError, match="losing accuracy twice"):
        plan_for(k2t, get_recipe("awq-w4a16"), 5 * 10**9)
