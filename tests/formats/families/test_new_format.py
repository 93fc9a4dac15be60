"""A weight format defined in this file alone — int8 per row with an F16 scale, under key names no
other format uses — converts a checkpoint of the throwaway family of ``test_new_family.py``
through a recipe defined here, verifies, is recorded in the manifest, is recognised by
``identify`` without it, and loads sharded: no other module knows it exists."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from test_new_family import TOY, write_toy_checkpoint

from hetquant.convert import (
    RECIPES,
    Recipe,
    SourceCheckpoint,
    Target,
    convert,
    keep,
    verify_artifact,
)
from hetquant.formats import FORMATS, TensorMeta, WeightFormat
from hetquant.formats.families import TensorRole, register_family, unregister_family
from hetquant.formats.identify import identify
from hetquant.runtime import ParallelLayout, open_artifact


@dataclass(frozen=True)
class ToyInt8(WeightFormat):
    """``w8`` I8 [out, in], ``w8_scale`` F16 [out]; ``W = w8 · w8_scale[:, None]``."""

    name: ClassVar[str] = "toy_int8"
    keys: ClassVar[frozenset[str]] = frozenset({"w8", "w8_scale"})

    def from_stored(self, metas: Mapping[str, TensorMeta]) -> tuple[ToyInt8, tuple[int, int]]:
        n, k = metas["w8"].shape
        return self, (n, k)

    def stored(self, shape: tuple[int, int]) -> dict[str, TensorMeta]:
        return {"w8": TensorMeta("I8", tuple(shape)), "w8_scale": TensorMeta("F16", (shape[0],))}

    def shard_axes(self, shape: tuple[int, int]) -> dict[str, tuple[int | None, int | None]]:
        return {"w8": (0, 1), "w8_scale": (0, None)}

    def quantize(self, weight: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
        w = weight.float()
        s = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).half()  # (out,)
        q = torch.round(w / s.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return {"w8": q, "w8_scale": s}

    def dequantize(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return tensors["w8"].float() * tensors["w8_scale"].float()[:, None]


@dataclass(frozen=True)
class ToyRecipe(Recipe):
    def assign(self, role: TensorRole, source_fmt: str) -> Target:
        linear = role.role.kind == "linear" and role.role.expert is None
        return Target.writing(ToyInt8()) if linear else keep(source_fmt)


@pytest.fixture(scope="module")
def toy_source(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    mp = pytest.MonkeyPatch()
    mp.setitem(FORMATS, ToyInt8.name, ToyInt8())
    mp.setitem(RECIPES, "toy-int8", ToyRecipe("toy-int8", "attention in toy_int8"))
    register_family(TOY)
    try:
        root = tmp_path_factory.mktemp("toy") / "src"
        yield root, write_toy_checkpoint(root)
    finally:
        unregister_family(TOY.name)
        mp.undo()


def test_new_format_converts_verifies_and_loads(toy_source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, state = toy_source
    out = tmp_path / "art"
    convert(SourceCheckpoint.open(root), out, RECIPES["toy-int8"], max_shard_size=1 << 20)
    assert verify_artifact(out) == []
    k = "model.layers.1.self_attn.k_proj"
    manifest = json.loads((out / "hetquant.json").read_text())
    assert manifest["module_formats"][k] == {
        "format": "toy_int8",
        "params": {},
        "shape": [128, 256],
    }
    art = open_artifact(out)
    assert art.modules[k].fmt == ToyInt8() and art.modules[k].shape == (128, 256)
    whole = art.load(ParallelLayout())
    full = ToyInt8().dequantize({key: whole[f"{k}.{key}"] for key in ("w8", "w8_scale")})
    ref = state[f"{k}.weight"].float()
    assert (full - ref).abs().max() <= ref.abs().amax(dim=1).max() / 127  # half a step, F16 scale
    halves = [art.load(ParallelLayout(tp_size=2, tp_rank=r)) for r in range(2)]
    parts = [
        ToyInt8().dequantize({key: h[f"{k}.{key}"] for key in ("w8", "w8_scale")}) for h in halves
    ]
    assert torch.equal(torch.cat(parts), full)
    experts = [n for n in whole if ".mlp.experts." in n and n.endswith(".weight")]
    assert experts and all(whole[n].dtype == torch.bfloat16 for n in experts)  # kept


def test_identify_finds_the_new_format_by_itself(toy_source) -> None:  # type: ignore[no-untyped-def]
    got = identify(ToyInt8().stored((12, 40)))
    assert got is not None and (got.fmt, got.shape) == (ToyInt8(), (12, 40))
