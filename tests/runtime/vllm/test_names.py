"""vLLM's module names against the artifact's (``runtime/vllm/names.py``) and the stored modules
behind a fused vLLM layer (``sources.layer_sources``), on the tiny DeepSeek-V4 hybrid: DeepSeek's
own names in the artifact, vLLM's renames as its V4 model's ``hf_to_vllm_mapper`` makes them
(``models/deepseek_v4/cpu/model.py`` ``_make_deepseek_v4_weights_mapper``, written out below as
a function: the real mapper is exercised in ``test_vllm_deepseek_v4_hybrid.py``). No vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_cli

from hetquant.runtime import open_artifact
from hetquant.runtime.loading.loader import Artifact
from hetquant.runtime.vllm.names import VllmNames
from hetquant.runtime.vllm.sources import layer_sources

PREFIX = {"layers.": "model.layers.", "embed.": "model.embed.", "norm.": "model.norm.",
          "hc_head": "model.hc_head"}  # fmt: skip
SUFFIX = {"head.weight": "lm_head.weight", "embed.weight": "embed_tokens.weight"}


def v4_rename(name: str) -> str | None:
    """vLLM 0.32's DeepSeek-V4 renames of a tensor name (mtp.* dropped on the CPU)."""
    if name.startswith("mtp."):
        return None
    name = name.replace(".shared_experts.w2", ".shared_experts.down_proj")
    for old, new in PREFIX.items():
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    for old, new in SUFFIX.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
            break
    return name


@pytest.fixture(scope="module")
def hybrid(tiny_v4: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    out = tmp_path_factory.mktemp("v4-names") / "hyb"
    res = run_cli("convert", tiny_v4["deepseek"], out, "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    return open_artifact(out)


def test_vllm_names_map_to_deepseeks_own(hybrid: Artifact) -> None:
    names = VllmNames(hybrid, v4_rename)
    known = hybrid.modules
    assert names.stored("model.layers.1.attn.wq_b", known) == "layers.1.attn.wq_b"
    assert names.stored("model.layers.0.ffn.shared_experts.down_proj", known) == (
        "layers.0.ffn.shared_experts.w2"
    )
    assert names.stored("model.layers.3.ffn.gate", known) == "layers.3.ffn.gate"
    assert names.stored("lm_head", known) == "head"
    assert names.stored("model.embed_tokens", known) == "embed"
    # a module the artifact does not store (vLLM's compressor fusion) stays vLLM's name
    assert names.stored("model.layers.1.attn.compressor.fused_wkv_wgate", known) == (
        "model.layers.1.attn.compressor.fused_wkv_wgate"
    )
    assert "mtp.0.attn.wq_b" not in names.stored_of.values()  # vLLM's CPU model drops MTP


def test_routed_experts_by_the_role_table(hybrid: Artifact) -> None:
    """Each decoder MoE layer's vLLM experts module names its layer; the MTP layer (mapped to
    nothing) and unknown modules name none."""
    names = VllmNames(hybrid, v4_rename)
    layers = range(hybrid.cfg.num_hidden_layers)
    assert names.experts_of == {f"model.layers.{n}.ffn.experts": n for n in layers}
    assert names.experts_layer("model.layers.9.ffn.experts") is None
    assert names.experts_layer("model.layers.0.ffn") is None
    assert set(hybrid.cpu_expert_files) > set(layers)  # the MTP layer's are stored, not served


def test_without_a_mapper_names_are_the_artifacts(hybrid: Artifact) -> None:
    names = VllmNames(hybrid)
    assert names.stored_of == {}
    assert names.stored("layers.1.attn.wq_b", hybrid.modules) == "layers.1.attn.wq_b"
    assert names.experts_layer("layers.2.ffn.experts") == 2


def test_a_stored_name_wins_over_the_inverse(hybrid: Artifact) -> None:
    """A vLLM name the artifact itself stores is taken as is, whatever the mapper's inverse."""
    names = VllmNames(hybrid, lambda n: n.replace("layers.0.", "layers.1.", 1))
    assert names.stored("layers.1.attn.wq_b", hybrid.modules) == "layers.1.attn.wq_b"


def test_fused_layer_sources_in_stored_names(hybrid: Artifact) -> None:
    """vLLM's fused ``fused_wqa_wkv`` / ``gate_up_proj`` stand for DeepSeek's ``wq_a`` + ``wkv`` /
    ``w1`` + ``w3``, stored W8A8_DYNAMIC; the unfused ``down_proj`` for ``w2``."""
    names = VllmNames(hybrid, v4_rename)
    packed = {"fused_wqa_wkv": ["wq_a", "wkv"], "gate_up_proj": ["w1", "w3"]}

    def stored(m: str) -> str:
        return names.stored(m, hybrid.modules)

    cases = {
        "model.layers.2.attn.fused_wqa_wkv": ("layers.2.attn.wq_a", "layers.2.attn.wkv"),
        "model.layers.1.ffn.shared_experts.gate_up_proj": (
            "layers.1.ffn.shared_experts.w1", "layers.1.ffn.shared_experts.w3",
        ),
        "model.layers.1.ffn.shared_experts.down_proj": ("layers.1.ffn.shared_experts.w2",),
        "model.layers.0.attn.wo_a": ("layers.0.attn.wo_a",),
    }  # fmt: skip
    for vllm, want in cases.items():
        got = layer_sources(hybrid, vllm, packed, stored)
        assert tuple(s.prefix for s in got) == want, vllm
        assert {s.fmt for s in got} == {"w8a8_dynamic"}, vllm
    # without the names, vLLM's prefix matches nothing the artifact stores
    assert not any(s.stored for s in layer_sources(hybrid, "model.layers.0.attn.wo_a", packed))
