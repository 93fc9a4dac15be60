"""Planning on the real Qwen3-235B-A22B / 30B-A3B layouts (FP8 and BF16, data as sparse holes)
reads headers only, matches the models' published sizes, and each recipe's planned artifact loads
at the TP sizes its formats allow — the loader's refusal lists the valid ones.

TP facts (reference/model_families.md §2.4): 235B's experts have moe_intermediate 1536, so TP8
leaves 192 rows / columns per rank: not a multiple of an FP8 128-block (vLLM refuses the FP8
source at TP8) or of an AWQ group of 128; a multiple of AWQ's 64-group, of NVFP4's 16-block and
trivially of per-channel W8A8 / INT4. The Ascend FP4 tile (256 rows) already fails at TP4 (384).
4 KV heads bound TP at 4 unless attention is data-parallel (``attn_dp``; KV-head replication is
not implemented).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from qwen3_planning import planned_modules, recipe_of, tp_sizes  # tests/convert is on sys.path

from hetquant.convert import SourceCheckpoint, plan_for, precision_table
from hetquant.formats import safetensors_io

REPO = Path(__file__).resolve().parents[3]
PARAMS = {"Qwen3-235B-A22B": 235_093_634_560, "Qwen3-30B-A3B": 30_532_122_624}


def _load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


LAYOUTS = _load("examples/qwen3-moe-layout/make_layout.py", "qwen3_layout")


CASES = [("Qwen3-235B-A22B", "fp8"), ("Qwen3-30B-A3B", "bf16")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], SourceCheckpoint]:
    root = tmp_path_factory.mktemp("qwen3-layouts")
    return {
        (m, d): SourceCheckpoint.open(LAYOUTS.write_layout(root / f"{m}-{d}", m, d))
        for m, d in CASES
    }


@pytest.mark.parametrize(("model", "dtype"), CASES)
def test_layout_is_the_published_size(sources, model: str, dtype: str) -> None:  # type: ignore[no-untyped-def]
    src = sources[(model, dtype)]
    params = sum(t.role.shape[0] * (t.role.shape[1] if len(t.role.shape) > 1 else 1)
                 for t in src.tensors.values())  # fmt: skip
    assert params == PARAMS[model]  # 235.09 B and 30.53 B, as Qwen publishes them
    layers = {"Qwen3-235B-A22B": 94, "Qwen3-30B-A3B": 48}[model]
    assert src.config.moe_layers == tuple(range(layers))
    fmts = {t.fmt_name for n, t in src.tensors.items() if ".experts." in n}
    assert fmts == ({"fp8_block"} if dtype == "fp8" else {"bf16"})


# recipe (+ options) → (valid TP sizes, with attn_dp, among 1/2/4/8/16; what the loader's refusal
# at TP 8 says). Without attn_dp the 4 KV heads refuse TP 8 first; the refusal then lists the
# sizes valid without and with attn_dp (every divisor, e.g. 3, 6, 12).
KV = "tp_size 8 does not divide 4 KV heads; valid tp sizes: "
EXPECTED_235B = {
    ("bf16", ()): ([1, 2, 4], [1, 2, 4, 8, 16], KV + "1, 2, 4 (with attn_dp=True: 1, 2, 3, 4, 6, 8,"),
    ("ascend-w8a8", ()): ([1, 2, 4], [1, 2, 4, 8, 16], KV + "1, 2, 4 (with attn_dp=True: 1, 2, 3, 4, 6, 8,"),
    ("ascend-hybrid", ()): ([1, 2, 4], [1, 2, 4, 8, 16], KV + "1, 2, 4"),
    # 1536 / 8 = 192 columns of down_proj per rank: not whole 128-groups, whole 64-groups
    ("awq-w4a16", ()): ([1, 2, 4], [1, 2, 4], KV + "1, 2, 4 (with attn_dp=True: 1, 2, 3, 4, 6, 12)"),
    ("awq-w4a16", ("--group-size", "64")): (
        [1, 2, 4], [1, 2, 4, 8], KV + "1, 2, 4 (with attn_dp=True: 1, 2, 3, 4, 6, 8, 12, 24)"),
    # the Ascend FP4 tile is 256 rows: 1536 / 4 = 384 rows of gate/up per rank do not tile
    ("fp4", ()): ([1, 2], [1, 2], KV + "1, 2 (with attn_dp=True: 1, 2, 3, 6)"),
    ("fp4", ("--fp4-layout", "nvfp4")): ([1, 2, 4], [1, 2, 4, 8, 16], KV + "1, 2, 4 (with attn_dp=True: 1, 2, 3, 4, 6, 8,"),
}  # fmt: skip


@pytest.mark.parametrize(("recipe", "extra"), list(EXPECTED_235B))
def test_plan_reads_headers_only_and_tp_sizes(sources, recipe: str, extra, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each recipe's plan of the 235B FP8 layout (headers only: reading data fails), its size,
    and the TP sizes its artifact loads at."""

    def no_data(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("planning touched tensor data")

    monkeypatch.setattr(safetensors_io.MappedFile, "__init__", no_data)
    src = sources[("Qwen3-235B-A22B", "fp8")]
    plan = plan_for(src, recipe_of(recipe, list(extra)), 5 * 10**9)
    table = precision_table(plan)
    assert table["params"] == PARAMS["Qwen3-235B-A22B"]
    if recipe == "ascend-hybrid":
        routed = next(g for g in table["groups"] if g["name"] == "routed_experts")
        assert routed["bits_per_weight"] < 4.02  # 4-bit codes + one F32 scale per row
    got = tp_sizes(src.config.raw, planned_modules(plan))
    tp, dp, needle = EXPECTED_235B[(recipe, extra)]
    assert (got["tp"], got["tp_attn_dp"]) == (tp, dp)
    assert needle in got["tp8_refusal"], got["tp8_refusal"]


@pytest.mark.parametrize("recipe", ["bf16", "ascend-hybrid", "awq-w4a16", "fp4"])
def test_planned_modules_are_the_written_artifacts(recipe: str, tiny_qwen3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What the TP predictions above rest on: the plan's modules (format, shape, stored tensors)
    are those ``open_artifact`` reads from the artifact the plan writes."""
    from hetquant.convert import convert
    from hetquant.runtime import open_artifact

    src = SourceCheckpoint.open(tiny_qwen3["fp8"])
    rec = recipe_of(recipe, [])
    planned = planned_modules(plan_for(src, rec, 1 << 20))
    convert(src, tmp_path / "out", rec, max_shard_size=1 << 20)
    written = open_artifact(tmp_path / "out").modules
    assert set(planned) == set(written)
    for name, info in written.items():
        p = planned[name]
        assert p.shape == info.shape
        assert {k: e.meta for k, (_, e) in p.entries.items()} == {
            k: e.meta for k, (_, e) in info.entries.items()
        }
        if p.fmt is not None:
            assert p.fmt == info.fmt
