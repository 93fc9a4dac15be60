"""Planning on the real DeepSeek-V3/R1 layout (163 shards, ~690 GB, stored as sparse holes) reads
headers only, and every recipe's plan is consistent with the real model's size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hetquant.convert import RECIPES, SourceCheckpoint, plan_for, precision_table
from hetquant.formats import safetensors_io

REPO = Path(__file__).resolve().parents[3]
MAIN_PARAMS = 671_026_419_200  # layers 0-60 + embeddings + head: DeepSeek's "671B"
MTP_PARAMS = 13_463_426_304  # layer 61 with its extras: "685B = 671B + 14B MTP"


def _make_layout():
    spec = importlib.util.spec_from_file_location(
        "make_layout", REPO / "examples/deepseek-v3-layout/make_layout.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_layout().write_layout(tmp_path_factory.mktemp("r1") / "DeepSeek-R1")


@pytest.fixture(scope="module")
def source(layout: Path) -> SourceCheckpoint:
    return SourceCheckpoint.open(layout)


def test_layout_is_the_real_one(layout: Path, source: SourceCheckpoint) -> None:
    shards = sorted(p.name for p in layout.glob("*.safetensors"))
    assert len(shards) == 163 and shards[-1] == "model-00163-of-000163.safetensors"
    assert sum(len(t.parts) for t in source.tensors.values()) == 91_991
    assert 688e9 < source.total_bytes < 690e9
    extras = [n for n, t in source.tensors.items() if t.parts[next(iter(t.parts))][0] == shards[-1]]
    assert sorted(extras) == sorted(
        f"model.layers.61.{x}"
        for x in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "embed_tokens.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
        )
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_dry_run_plan_reads_headers_only(
    source: SourceCheckpoint, recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_data(*args, **kwargs):
        raise AssertionError("planning touched tensor data")

    monkeypatch.setattr(safetensors_io.MappedFile, "__init__", no_data)
    plan = plan_for(source, RECIPES[recipe], 5 * 10**9)
    table = precision_table(plan)
    assert table["params"] == MAIN_PARAMS + MTP_PARAMS
    root = [f for f in plan.files if f.part == "root"]
    assert all(f.data_size <= 5 * 10**9 or len(f.tensors) == 1 for f in root)
    if recipe == "ascend-hybrid":
        cpu = [f for f in plan.files if f.part == "cpu_experts"]
        assert len(cpu) == 59  # 58 MoE layers + the MTP layer
        routed = next(g for g in table["groups"] if g["name"] == "routed_experts")
        assert routed["bits_per_weight"] < 4.02  # 4-bit codes + one F32 scale per row
