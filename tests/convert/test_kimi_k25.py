"""Kimi K2.5 (``formats/families/kimi_k25.py``): its text decoder is Kimi K2 Thinking's under
``language_model.``, converted as K2 Thinking is — byte for byte, the INT4 experts kept or
repacked losslessly — with the vision tower and projector at source precision; the text path runs
as K2's.

The tiny source (``examples/kimi-k25/make_tiny.py``) is the tiny K2 Thinking checkpoint renamed,
plus transformers' Kimi_K25 vision tower under the checkpoint's original names, and its
compressed-tensors ``quantization_config`` inside ``text_config``.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hetquant.convert import SourceCheckpoint
from hetquant.convert.verify import verify_artifact
from hetquant.formats.families.vlm import VlmFamily
from hetquant.runtime.serving.run import RunSpec, run_artifact

REPO = Path(__file__).resolve().parents[2]
TOKENS = (5, 17, 42, 100, 7, 300, 250, 11)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")  # the vision tower's classes
    base = tmp_path_factory.mktemp("kimi-k25")
    k25 = SimpleNamespace(**runpy.run_path(str(REPO / "examples" / "kimi-k25" / "make_tiny.py")))
    k2 = SimpleNamespace(**runpy.run_path(str(REPO / "examples" / "kimi-k2" / "make_tiny.py")))
    k2.write_checkpoint(base / "k2", "thinking")
    return {"k25": k25.write_checkpoint(base / "k25"), "k2": base / "k2"}


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.rglob("*.safetensors")):
        rel = f.parent.relative_to(root).as_posix()
        out |= {f"{rel}/{k}": v for k, v in load_file(str(f)).items()}
    return out


def _renamed(key: str) -> str:
    rel, _, name = key.partition("/")
    return f"{rel}/language_model.{name}" if name.startswith(("model.", "lm_head.")) else key


def test_source_reads_as_k2_thinking_plus_vision(sources: dict[str, Path]) -> None:
    src = SourceCheckpoint.open(sources["k25"])
    assert isinstance(src.config.family, VlmFamily) and src.config.family.name == "kimi_k25"
    assert src.config.num_experts == 12 and src.config.quantization_config["format"]
    k2 = SourceCheckpoint.open(sources["k2"])
    text = {n for n in src.tensors if n.startswith("language_model.")}
    assert text == {"language_model." + n for n in k2.tensors}
    expert = "language_model.model.layers.1.mlp.experts.3.down_proj.weight"
    assert src.tensors[expert].fmt_name == "ct_pack_quantized"
    vision = sorted(n for n in src.tensors if not n.startswith("language_model."))
    assert len(vision) == 3 + 2 * 12 + 2 + 6  # patch embed, 2 blocks, final norm, projector


@pytest.mark.parametrize(
    "recipe", ["bf16", "ascend-hybrid", "ascend-w8a8", "ascend-w4a16", "ct-w4a16"]
)
def test_recipes_convert_the_text_decoder_as_k2_thinking(
    cli, recipe: str, sources: dict[str, Path], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Every K2 Thinking tensor of the artifact is in the K2.5 one, renamed, with its bytes (the
    INT4 experts: kept as stored by ascend-w4a16 / ct-w4a16, repacked losslessly by the hybrid);
    the rest is the vision tower, BF16 as stored."""
    outs = {}
    for label in ("k25", "k2"):
        outs[label] = tmp_path / label
        res = cli("convert", sources[label], outs[label], "--recipe", recipe)
        assert res.exit_code == 0, res.stderr
    assert verify_artifact(outs["k25"]) == []  # its INT4 group 32 replayed from the manifest
    k25, k2 = _tensors(outs["k25"]), _tensors(outs["k2"])
    renamed = {_renamed(k): t for k, t in k2.items()}
    assert set(renamed) <= set(k25)
    for key, t in renamed.items():
        other = k25[key]
        assert t.dtype == other.dtype and t.shape == other.shape, key
        assert torch.equal(t.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), (
            key
        )
    rest = {k for k in k25 if k not in renamed}
    assert rest and all(k.startswith(("./vision_tower.", "./mm_projector.")) for k in rest)
    src = SourceCheckpoint.open(sources["k25"])
    for key in rest:
        assert torch.equal(k25[key], src.weight(key[2:])), key
    cfg = json.loads((outs["k25"] / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and "quantization_config" not in cfg["text_config"]


@pytest.mark.parametrize("recipe", ["awq-w4a16", "fp4", "ascend-w4a8"])
def test_requantizing_the_int4_experts_refused_as_for_k2_thinking(
    cli, recipe: str, sources: dict[str, Path], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    res = cli("convert", sources["k25"], tmp_path / "out", "--recipe", recipe)
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "ct_pack_quantized" in line and "--requantize" in line, line
    assert not (tmp_path / "out" / "hetquant.json").exists()


def test_text_path_runs_as_k2(cli, sources: dict[str, Path], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """hetquant run of the K2.5 bf16 artifact gives K2 Thinking's logits, bit for bit, TP2 too."""
    logits = {}
    for label in ("k25", "k2"):
        out = tmp_path / label
        assert cli("convert", sources[label], out, "--recipe", "bf16").exit_code == 0
        for tp in (1, 2):
            logits[label, tp], _ = run_artifact(RunSpec(str(out), TOKENS, tp=tp))
    for tp in (1, 2):
        assert np.array_equal(logits["k25", tp], logits["k2", tp])
    assert float(np.abs(logits["k2", 1] - logits["k2", 2]).max()) < 1e-3


def test_quantize_vision_writes_the_blocks_mlp_msmodelslim_quantizes(
    cli, sources: dict[str, Path], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """``--quantize-vision``: the vision blocks' mlp.fc0 / fc1 in W8A8_DYNAMIC (msModelSlim's K2.5
    W4A8 recipe, ``*mlp*``), wqkv / wo / the projector as stored; the text part unchanged."""
    outs = {}
    for label, extra in (("plain", []), ("vision", ["--quantize-vision"])):
        outs[label] = tmp_path / label
        res = cli("convert", sources["k25"], outs[label], "--recipe", "ascend-w4a16", *extra)
        assert res.exit_code == 0, res.stderr
    assert verify_artifact(outs["vision"]) == []
    desc = json.loads((outs["vision"] / "quant_model_description.json").read_text())
    vision = {k: v for k, v in desc.items() if k.startswith(("vision_tower.", "mm_projector."))}
    quantized = {k for k, v in vision.items() if v != "FLOAT"}
    blocks = "vision_tower.encoder.blocks."
    assert quantized == {f"{blocks}{b}.mlp.{fc}.{k}" for b in (0, 1) for fc in ("fc0", "fc1")
                         for k in ("weight", "weight_scale", "weight_offset")}  # fmt: skip
    assert {desc[k] for k in quantized} == {"W8A8_DYNAMIC"}
    plain, got = _tensors(outs["plain"]), _tensors(outs["vision"])
    changed = {k for k in got if not (k in plain and torch.equal(plain[k], got[k]))}
    assert changed and all(".mlp.fc" in k and k.startswith(f"./{blocks}") for k in changed)
