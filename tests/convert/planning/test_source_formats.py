"""A source is any registered format: compressed-tensors INT4 experts (as Kimi K2 Thinking ships
them) and plain BF16 checkpoints convert; every source weight is read through its own format."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support import INDEX, TINY, read_json, st_bytes, write_json

from hetquant.convert import SourceCheckpoint
from hetquant.formats import HetquantError, get_format

CT = get_format("ct_pack_quantized", group_size=32)
FP8 = get_format("fp8_block")
ROUTED = ".mlp.experts."


def _tiny_state() -> dict[str, torch.Tensor]:
    index = read_json(TINY / INDEX)["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        state.update(load_file(str(TINY / shard)))
    return state


def _bf16_of(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return FP8.dequantize_bf16(state[name], state[name + "_scale_inv"])


def _write_source(dst: Path, state: dict[str, torch.Tensor], edit_config: Callable) -> Path:
    """``state`` as a two-shard checkpoint (second half of the names in the second shard)."""
    dst.mkdir(parents=True)
    for f in TINY.iterdir():
        if (f.suffix == ".json" and f.name != INDEX) or f.name == "tokenizer.json":
            shutil.copy(f, dst / f.name)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    halves["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    weight_map = {}
    for file, part in halves.items():
        save_file({n: state[n].contiguous() for n in part}, str(dst / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    write_json(dst / INDEX, {"metadata": {}, "weight_map": weight_map})
    cfg = read_json(dst / "config.json")
    edit_config(cfg)
    write_json(dst / "config.json", cfg)
    return dst


@pytest.fixture(scope="module")
def ct_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Routed experts as compressed-tensors pack-quantized INT4 (group 32, BF16 scales), the
    rest as in the FP8 source: Kimi K2 Thinking's layout on the tiny model."""
    state = _tiny_state()
    for name in [n for n in state if ROUTED in n and n.endswith(".weight")]:
        prefix = name.removesuffix(".weight")
        packed = CT.quantize(_bf16_of(state, name).float())
        del state[name], state[name + "_scale_inv"]
        state.update({f"{prefix}.{k}": t for k, t in packed.items()})
    return _write_source(tmp_path_factory.mktemp("ct") / "src", state, lambda c: None)


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every FP8 weight dequantized exactly to BF16, quantization_config gone: a BF16 release."""
    state = _tiny_state()
    for name in [n for n in state if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        state[weight] = _bf16_of(state, weight)
        del state[name]
    return _write_source(
        tmp_path_factory.mktemp("bf16") / "src", state, lambda c: c.pop("quantization_config")
    )


def _ct_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16(q · s) from the stored words, unpacked independently: q = nibble(4i) − 8."""
    words = packed.numpy().astype(np.uint32)  # (N, K/8)
    nib = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # (N, K/8, 8)
    q = torch.from_numpy(nib.reshape(words.shape[0], -1).astype(np.float32) - 8)  # (N, K)
    s = scale.float().repeat_interleave(32, dim=1)  # (N, K)
    return (q * s).to(torch.bfloat16)


def test_ct_experts_are_identified_with_their_parameters(ct_source: Path) -> None:
    src = SourceCheckpoint.open(ct_source)
    routed = [t for n, t in src.tensors.items() if ROUTED in n]
    assert routed and {t.fmt for t in routed} == {CT}
    assert all(set(t.parts) == {"weight_packed", "weight_scale", "weight_shape"} for t in routed)
    others = {t.fmt_name for n, t in src.tensors.items() if ROUTED not in n}
    assert others == {"fp8_block", "bf16", "plain"}


def test_bf16_recipe_dequantizes_ct_experts_exactly(cli, ct_source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = cli("convert", ct_source, out, "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    index = read_json(out / INDEX)["weight_map"]
    state = {}
    for shard in sorted(set(read_json(ct_source / INDEX)["weight_map"].values())):
        state.update(load_file(str(ct_source / shard)))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    prefix = name.removesuffix(".weight")
    want = _ct_reference(state[f"{prefix}.weight_packed"], state[f"{prefix}.weight_scale"])
    got = st_bytes(out / index[name], name)
    assert got == want.view(torch.int16).numpy().tobytes()
    manifest = read_json(out / "hetquant.json")
    assert manifest["source"]["formats"]["expert_down"] == "ct_pack_quantized"
    assert cli("verify", out).exit_code == 0


@pytest.mark.parametrize("recipe", ["ascend-w8a8", "awq-w4a16", "fp4", "ascend-hybrid"])
def test_bf16_source_gives_the_fp8_sources_bytes(
    cli, bf16_source: Path, tmp_path: Path, recipe: str
) -> None:
    """The BF16 source is the FP8 one dequantized exactly, so every quantized tensor is equal."""
    outs = {}
    for name, src in (("fp8", TINY), ("bf16", bf16_source)):
        outs[name] = tmp_path / name
        res = cli("convert", src, outs[name], "--recipe", recipe)
        assert res.exit_code == 0, res.stderr
    for f in sorted(outs["fp8"].rglob("*.safetensors")):
        rel = f.relative_to(outs["fp8"])
        assert f.read_bytes() == (outs["bf16"] / rel).read_bytes(), rel
    fmts = read_json(outs["bf16"] / "hetquant.json")["source"]["formats"]
    assert fmts["q_a"] == "bf16" and fmts["attn_norm"] == "plain"


def _edit_state(src: Path, name: str, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = src / read_json(src / INDEX)["weight_map"][name]
    tensors = {k: v.clone() for k, v in load_file(str(file)).items()}
    fn(tensors)
    save_file(tensors, str(file), {"format": "pt"})


EXPERT = "model.layers.1.mlp.experts.3.up_proj"


def _drop(key: str) -> Callable[[Path], None]:
    def corrupt(src: Path) -> None:
        _edit_state(src, f"{EXPERT}.{key}", lambda t: t.pop(f"{EXPERT}.{key}"))
        doc = read_json(src / INDEX)
        doc["weight_map"].pop(f"{EXPERT}.{key}")
        write_json(src / INDEX, doc)

    return corrupt


def _scale_dtype(src: Path) -> None:
    name = f"{EXPERT}.weight_scale"
    _edit_state(src, name, lambda t: t.__setitem__(name, t[name].float()[:, :3].contiguous()))


@pytest.mark.parametrize(
    ("corrupt", "needles"),
    [
        (_drop("weight_shape"), (EXPERT, "fit no format", f"{EXPERT}.weight_packed is I32[")),
        (_drop("weight_packed"), (f"{EXPERT}.weight", "lacks")),
        (_scale_dtype, (EXPERT, "fit no format", f"{EXPERT}.weight_scale is F32[")),
    ],
)
def test_broken_ct_modules_are_refused(
    cli, ct_source: Path, tmp_path: Path, corrupt: Callable[[Path], None], needles: tuple
) -> None:
    src = tmp_path / "src"
    shutil.copytree(ct_source, src)
    corrupt(src)
    res = cli("convert", src, tmp_path / "out", "--recipe", "bf16")
    assert res.exit_code == 2, res.stderr
    line = res.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("error: "), res.stderr
    assert all(n in line[0] for n in needles), (needles, line[0])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_source_config_fixes_the_fp8_block(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    cfg = read_json(src / "config.json")
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HetquantError, match=r"weight_scale_inv is F32\[\d+, \d+\], expected F32"):
        SourceCheckpoint.open(src)


@pytest.fixture(scope="module")
def ue8m0_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3.1's FP8: every block scale a power of two, config says scale_fmt ue8m0."""
    state = _tiny_state()
    for name in [n for n in state if n.endswith("_scale_inv")]:
        state[name] = torch.exp2(torch.ceil(torch.log2(state[name])))  # (sr, sc)

    def v31(cfg: dict) -> None:
        cfg["quantization_config"]["scale_fmt"] = "ue8m0"

    return _write_source(tmp_path_factory.mktemp("v31") / "src", state, v31)


def test_ue8m0_source_dequantizes_exactly(cli, ue8m0_source: Path, tmp_path: Path) -> None:
    from support import bf16_bits, fp8_codes, ref_dequant_bits

    src = SourceCheckpoint.open(ue8m0_source)
    assert {t.fmt.scale_fmt for t in src.tensors.values() if t.fmt_name == "fp8_block"} == {"ue8m0"}
    out = tmp_path / "out"
    assert cli("convert", ue8m0_source, out, "--recipe", "bf16").exit_code == 0
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # a partial block row
    parts = src.stored(name)
    want = ref_dequant_bits(fp8_codes(parts["weight"]), parts["weight_scale_inv"].numpy())
    file = out / read_json(out / INDEX)["weight_map"][name]
    got = np.frombuffer(st_bytes(file, name), dtype=np.uint16).reshape(want.shape)
    assert np.array_equal(got, want) and np.array_equal(bf16_bits(src.dequantized(name)), want)


def test_ue8m0_scale_that_is_not_a_power_of_two_is_refused(
    cli, ue8m0_source: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shutil.copytree(ue8m0_source, src)
    name = "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"
    _edit_state(src, name, lambda t: t[name].__setitem__((0, 1), 0.75 * float(t[name][0, 1])))
    res = cli("convert", src, tmp_path / "out", "--recipe", "ascend-w8a8")
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert line.startswith(f"error: {name}: scale ") and "not a power of two" in line
    assert "scale_fmt ue8m0" in line and "\n" not in line
