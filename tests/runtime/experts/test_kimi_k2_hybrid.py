"""ascend-hybrid from Kimi K2 Thinking keeps the CPU experts lossless: the QAT codes and group-32
scales are repacked into ``int4_cpu_group_experts`` (never dequantized and re-quantized), they
dequantize to exactly the source's ``q · s``, and the CPU expert pool runs them within the GEMV
bound of the source's own weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gemv_reference import assert_within, routed_ref_and_bound, routing
from safetensors.torch import load_file
from support import make_kimi_k2, read_json

from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats.base import stored_metas
from hetquant.formats.int4_cpu_group import Int4CpuGroupExperts, dequantize_expert
from hetquant.runtime.experts.expert_pool import CpuExpertPool
from hetquant.runtime.serving.run import RunSpec, run_artifact

LAYER = 2


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[SourceCheckpoint, Path]:
    base = tmp_path_factory.mktemp("k2-hybrid")
    src = SourceCheckpoint.open(make_kimi_k2(base / "src", "thinking"))
    convert(src, base / "art", get_recipe("ascend-hybrid"), max_shard_size=1 << 40)
    return src, base / "art"


def _source_expert(src: SourceCheckpoint, e: int) -> tuple[torch.Tensor, ...]:
    fam = src.config.family
    return tuple(src.tensors[f"{m}.weight"].fmt.dequantize(src.stored(f"{m}.weight"))
                 for m in fam.mlp_modules("routed", LAYER, e))  # fmt: skip


def test_cpu_experts_are_the_source_codes_and_scales(built) -> None:
    src, art = built
    manifest = read_json(art / "hetquant.json")
    assert manifest["recipe"]["options"] == {}  # no --requantize needed: nothing re-quantized
    layer = load_file(art / "cpu_experts" / f"layer_{LAYER:03d}.safetensors")
    layer = {k.rpartition(".")[2]: v for k, v in layer.items()}
    assert Int4CpuGroupExperts().from_stored(stored_metas(layer))[0].group_size == 32
    for e in range(src.config.num_experts):
        got = dequantize_expert(layer, e)
        for g, want in zip(got, _source_expert(src, e), strict=True):
            assert torch.equal(g, want)  # float32 q · f32(s), bit for bit
        down = src.stored(f"model.layers.{LAYER}.mlp.experts.{e}.down_proj.weight")
        assert torch.equal(layer["down_packed"][e], down["weight_packed"].view(torch.uint8))
        assert torch.equal(layer["down_scale"][e], down["weight_scale"])


def test_pool_runs_them_against_the_source_weights(built) -> None:
    src, art = built
    hidden = src.config.hidden_size
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(2))
    ids, w = routing(6, src.config.num_experts, 3, seed=4)
    with CpuExpertPool.open(art, subpools=2) as pool:
        assert pool.info(LAYER).fmt == Int4CpuGroupExperts(32)
        got = pool.forward(LAYER, x, ids, w)
    layer = load_file(art / "cpu_experts" / f"layer_{LAYER:03d}.safetensors")
    layer = {k.rpartition(".")[2]: v for k, v in layer.items()}
    ref, bound = routed_ref_and_bound(layer, x, ids, w, 2, lambda _l, e: _source_expert(src, e))
    assert_within(got, ref, bound)


def test_hetquant_run_on_the_hybrid_artifact(built) -> None:
    src, art = built
    logits, _ = run_artifact(RunSpec(str(art), (5, 17, 42, 100, 7)))
    assert (
        logits.shape == (5, src.config.vocab_size)
        and torch.isfinite(torch.from_numpy(logits)).all()
    )
