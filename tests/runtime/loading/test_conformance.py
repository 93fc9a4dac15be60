"""``open_artifact`` refuses an artifact whose stored tensors disagree with its config.json
(issue 25 §2): a shape that differs, a tensor the config implies that no file stores, one stored
that the config does not imply — in the root shards and in ``cpu_experts/`` alike, from headers
only. ``tests/convert/test_untrusted_artifacts.py`` drives the same cases through the commands."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import (
    INDEX,
    drop_listed_file,
    edit_index,
    read_json,
    resave_shard,
    shard_of,
    write_json,
)

from hetquant.formats import HetquantError
from hetquant.runtime.loading.loader import open_artifact

NORM = "model.layers.0.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
LAYER2 = "cpu_experts/layer_002.safetensors"


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


def _config(**changes: object) -> Callable[[Path], None]:
    def edit(art: Path) -> None:
        write_json(art / "config.json", {**read_json(art / "config.json"), **changes})

    return edit


def narrow_norm(art: Path) -> None:
    """``NORM`` re-saved with 200 of its 256 entries (a valid shard; only the shape is off)."""

    def cut(tensors: dict[str, torch.Tensor]) -> None:
        tensors[NORM] = tensors[NORM][:200].clone()

    resave_shard(shard_of(art, NORM), cut)


def add_tensor(art: Path) -> None:
    name = "model.layers.0.mlp.extra_proj.weight"
    resave_shard(shard_of(art, NORM), lambda t: t.update({name: torch.zeros(4, 4)}))
    edit_index(art, lambda doc: doc["weight_map"].update({name: shard_of(art, NORM).name}))


def expert_in_root(art: Path) -> None:
    """A routed expert's weight added to the root shard, while cpu_experts/ stacks it too."""
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    resave_shard(shard_of(art, NORM), lambda t: t.update({name: torch.zeros(256, 256)}))
    edit_index(art, lambda doc: doc["weight_map"].update({name: shard_of(art, NORM).name}))


def keep_experts(n: int, file: str = LAYER2) -> Callable[[Path], None]:
    """The cpu_experts layer ``file`` re-saved with its first ``n`` experts only."""

    def edit(art: Path) -> None:
        tensors = {k: v[:n].clone() for k, v in load_file(str(art / file)).items()}
        save_file(tensors, str(art / file))

    return edit


def drop_layer_file(art: Path) -> None:
    """A cpu_experts layer file deleted, and dropped from the manifest too."""
    drop_listed_file(art, LAYER2)


ROOT_CASES = {
    "norm-width": (narrow_norm, rf"{NORM} has shape \[200\] but config.json implies \[256\]"),
    "vocab": (_config(vocab_size=600), rf"{EMBED} has shape \[640, 256\] but config.json implies \[600, 256\]"),
    "fewer-layers": (_config(num_hidden_layers=2), r"config.json (implies|does not imply)"),
    "more-layers": (_config(num_hidden_layers=4), r"config.json implies model.layers.4\..* which no file"),
    "extra-tensor": (add_tensor, r"stores model.layers.0.mlp.extra_proj.weight \[4, 4\], which config.json does not imply"),
}  # fmt: skip
POOL_CASES = {
    "stored-twice": (expert_in_root, r"layer_001.safetensors: model.layers.1.mlp.experts.0.gate_proj.weight is stored twice, here and in .*model-00001-of-00001.safetensors"),
    "fewer-experts": (keep_experts(4), r"implies model.layers.2.mlp.experts.4.gate_proj.weight .* which no file"),
    "layer-file-gone": (drop_layer_file, r"implies model.layers.2.mlp.experts.0.gate_proj.weight .* which no file"),
    "expert-count": (_config(n_routed_experts=16), r"mlp.gate.weight has shape \[8, 256\] but config.json implies \[16, 256\]"),
}  # fmt: skip


def test_intact_artifacts_open(tiny_artifact: Path, tiny_hybrid: Path) -> None:
    for art in (tiny_artifact, tiny_hybrid):
        assert open_artifact(art).modules


@pytest.mark.parametrize("case", sorted(ROOT_CASES))
def test_root_tensors_must_agree_with_config(
    tiny_artifact: Path, tmp_path: Path, case: str
) -> None:
    edit, match = ROOT_CASES[case]
    art = _copy(tiny_artifact, tmp_path)
    edit(art)
    with pytest.raises(HetquantError, match=match) as e:
        open_artifact(art)
    assert "\n" not in str(e.value) and "re-download it or re-run the conversion" in str(e.value)


@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_cpu_expert_layers_must_agree_with_config(
    tiny_hybrid: Path, tmp_path: Path, case: str
) -> None:
    edit, match = POOL_CASES[case]
    art = _copy(tiny_hybrid, tmp_path)
    edit(art)
    with pytest.raises(HetquantError, match=match):
        open_artifact(art)


def test_the_check_reads_headers_only(tiny_hybrid: Path, tmp_path: Path) -> None:
    """Shapes come from headers: an artifact whose tensor bytes are all zero opens the same."""
    art = _copy(tiny_hybrid, tmp_path)
    for f in [art / f for f in set(read_json(art / INDEX)["weight_map"].values())]:
        n = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        f.write_bytes(f.read_bytes()[:n] + bytes(f.stat().st_size - n))
    assert open_artifact(art).modules.keys() == open_artifact(tiny_hybrid).modules.keys()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (keep_experts(4), r"implies model.layers.2.mlp.experts.4.gate_proj.weight .* which no file"),
        (_config(moe_intermediate_size=128), r"layer_001.safetensors: model.layers.1.mlp.experts.0.gate_proj.weight has shape \[256, 256\] but config.json implies \[128, 256\]"),
        (_config(first_k_dense_replace=2), r"layer_001.safetensors: stores model.layers.1.mlp.experts.0.gate_proj.weight .* which config.json does not imply"),
    ],
    ids=["fewer-experts", "inter", "dense-layer"],
)  # fmt: skip
def test_the_pool_opened_alone_checks_its_layers(
    tiny_hybrid: Path, tmp_path: Path, edit: Callable[[Path], None], match: str
) -> None:
    from hetquant.runtime.experts.expert_pool import CpuExpertPool

    art = _copy(tiny_hybrid, tmp_path)
    edit(art)
    with pytest.raises(HetquantError, match=match):
        CpuExpertPool.open(art)
