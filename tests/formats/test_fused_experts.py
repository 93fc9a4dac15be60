"""Fused 3-D expert sources (``formats/fused_experts.py``): read expert by expert, bit-exactly.

The tiny Qwen3-MoE BF16 source rewritten with fused experts, in both orientations, opens to the
same per-expert tensors as the original, byte for byte; the bf16 recipe writes the same tensors;
each expert is a byte range of one expert's block, never the 3-D tensor; bad fused tensors are
refused by name. What transformers 5.24's ``save_pretrained`` writes is measured here too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hetquant.convert import SourceCheckpoint, convert
from hetquant.convert.recipes import get_recipe
from hetquant.formats import HetquantError
from hetquant.formats.fused_experts import ExpertSlice

P = "model.layers.{layer}.mlp.experts"
E = 8  # tiny Qwen3-MoE's experts


def fuse_shards(root: Path, transposed: bool, dtype: torch.dtype | None = None) -> None:
    """Rewrite ``root``'s per-expert routed experts as fused gate_up / down tensors."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(root / shard))
        for layer in (0, 2):  # the MoE layers (layer 1 is dense)
            p = P.format(layer=layer)
            mine = {n: tensors.pop(n) for n in list(tensors) if n.startswith(p + ".")}
            if not mine:
                continue
            gate_up = torch.stack([torch.cat([mine[f"{p}.{e}.gate_proj.weight"],
                                              mine[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])  # fmt: skip
            down = torch.stack([mine[f"{p}.{e}.down_proj.weight"] for e in range(E)])
            if transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            if dtype is not None:
                gate_up, down = gate_up.to(dtype), down.to(dtype)
            tensors[f"{p}.gate_up_proj"] = gate_up.contiguous()
            tensors[f"{p}.down_proj"] = down.contiguous()
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    index["weight_map"] = dict(sorted(weight_map.items()))
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _fused_copy(tiny_qwen3: dict[str, Path], tmp_path: Path, transposed: bool, **kw) -> Path:  # type: ignore[no-untyped-def]
    src = tmp_path / f"fused-{transposed}"
    shutil.copytree(tiny_qwen3["bf16"], src)
    fuse_shards(src, transposed, **kw)
    return src


@pytest.mark.parametrize("transposed", [True, False])
def test_fused_source_reads_per_expert_bit_exact(
    tiny_qwen3: dict[str, Path], tmp_path: Path, transposed: bool
) -> None:
    ref = SourceCheckpoint.open(tiny_qwen3["bf16"])
    src = SourceCheckpoint.open(_fused_copy(tiny_qwen3, tmp_path, transposed))
    assert sorted(src.tensors) == sorted(ref.tensors)
    gate = src.tensors[f"{P.format(layer=2)}.5.gate_proj.weight"]
    entry = gate.parts["weight"][1]
    assert isinstance(entry, ExpertSlice) and entry.transposed is transposed
    h, i = 256, 256  # hidden, moe_intermediate
    assert entry.nbytes == i * h * 2 and entry.end - entry.start == 2 * i * h * 2  # one block
    for name in ref.tensors:
        a, b = ref.weight(name), src.weight(name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
        if ".experts." in name:  # the numpy path (the native lane's) too
            a_np, b_np = ref.weight_array(name)[1], src.weight_array(name)[1]
            assert b_np.flags.c_contiguous and np.array_equal(a_np, b_np), name


def test_bf16_recipe_of_a_fused_source_is_the_per_expert_one(
    tiny_qwen3: dict[str, Path], tmp_path: Path
) -> None:
    """The artifact's per-expert linears are the source bytes rearranged: its tensors equal the
    per-expert source's artifact bit for bit."""
    outs = []
    for label, root in (("ref", tiny_qwen3["bf16"]),
                        ("fused", _fused_copy(tiny_qwen3, tmp_path, True))):  # fmt: skip
        out = tmp_path / label
        convert(SourceCheckpoint.open(root), out, get_recipe("bf16"), max_shard_size=1 << 20)
        outs.append(out)
    tensors = [{}, {}]
    for k, out in enumerate(outs):
        for f in sorted(out.glob("model-*.safetensors")):
            tensors[k] |= load_file(str(f))
    assert sorted(tensors[0]) == sorted(tensors[1])
    for name, t in tensors[0].items():
        assert torch.equal(t.view(torch.int16), tensors[1][name].view(torch.int16)), name


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (lambda t: {k: (v[:, :, :-2].contiguous() if k.endswith("2.mlp.experts.down_proj") else v)
                    for k, v in t.items()},
         ("model.layers.2.mlp.experts.down_proj", "disagrees with config.json", "[8, 256, 256]")),
        (lambda t: {k: v for k, v in t.items() if not k.endswith("0.mlp.experts.down_proj")},
         ("model.layers.0.mlp.experts.gate_up_proj", "down_proj is missing")),
        (lambda t: {k: (v.to(torch.float8_e4m3fn) if k.endswith("0.mlp.experts.gate_up_proj") else v)
                    for k, v in t.items()},
         ("model.layers.0.mlp.experts.gate_up_proj", "fused F8_E4M3 experts are not read")),
    ],
)  # fmt: skip
def test_bad_fused_tensors_refused_by_name(
    tiny_qwen3: dict[str, Path], tmp_path: Path, edit, needles: tuple[str, ...]
) -> None:
    root = _fused_copy(tiny_qwen3, tmp_path, True)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(str(root / shard)))
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    index["weight_map"] = weight_map
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HetquantError) as e:
        SourceCheckpoint.open(root)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_what_transformers_save_pretrained_writes(tmp_path: Path) -> None:
    """transformers 5.24: Qwen3MoeForCausalLM saves per-expert tensors (its fused module layout
    reverted); Qwen3VLMoeForConditionalGeneration saves its module layout [E, 2I, H] / [E, H, I]
    (not the released [E, H, 2I]): both read by hetquant (the latter by shape)."""
    tf = pytest.importorskip("transformers")
    text = dict(vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                num_experts_per_tok=2, head_dim=16)  # fmt: skip
    tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**text)).save_pretrained(tmp_path / "q3")
    with safe_open(str(tmp_path / "q3" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                  num_position_embeddings=16, deepstack_visual_indexes=[0], patch_size=4)  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
            "mrope_interleaved": True}  # fmt: skip
    cfg = tf.Qwen3VLMoeConfig(text_config={**text, "rope_parameters": rope}, vision_config=vision)
    tf.Qwen3VLMoeForConditionalGeneration(cfg).save_pretrained(tmp_path / "vl")
    with safe_open(str(tmp_path / "vl" / "model.safetensors"), "pt") as f:
        p = "model.language_model.layers.0.mlp.experts"
        assert f.get_slice(f"{p}.gate_up_proj").get_shape() == [4, 32, 48]  # [E, 2I, H]
        assert f.get_slice(f"{p}.down_proj").get_shape() == [4, 48, 16]  # [E, H, I]
