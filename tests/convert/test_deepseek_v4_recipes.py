"""DeepSeek-V4 sources (``examples/tiny-deepseek-v4/make_tiny.py``: DeepSeek's FP8 + FP4 layout and
transformers' BF16 layout of one model) through every recipe, and their bad inputs.

Both layouts dequantize to the same model; recipes that would put the FP4 experts on another
4-bit grid refuse without ``--requantize``; the hybrid keeps the experts' codes and scales
byte for byte in ``cpu_experts/`` and its CPU pool computes them exactly (the int8 reference).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, safe_open, save_file
from support import REPO, read_json, run_cli

from hetquant.formats import get_format
from hetquant.formats.fp4_cpu import fp4_gemv_int8
from hetquant.runtime import ParallelLayout, open_artifact

GEN = runpy.run_path(str(REPO / "examples" / "tiny-deepseek-v4" / "make_tiny.py"))
EXPERT = "layers.1.ffn.experts.5.w1"


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"deepseek": dir, "transformers": dir}, generated once. Read-only."""
    base = tmp_path_factory.mktemp("tiny-v4")
    return {k: GEN["write_checkpoint"](base / k, k) for k in ("deepseek", "transformers")}


def _convert(src: Path, out: Path, recipe: str, *opts: str) -> None:
    res = run_cli("convert", src, out, "--recipe", recipe, *opts)
    assert res.exit_code == 0, res.stderr
    assert run_cli("verify", out).exit_code == 0


def _tensors(art: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(art.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_both_layouts_are_one_model(v4: dict[str, Path], tmp_path: Path) -> None:
    """bf16 of DeepSeek's FP8 + FP4 layout equals transformers' BF16 save value for value."""
    _convert(v4["deepseek"], tmp_path / "ds", "bf16")
    _convert(v4["transformers"], tmp_path / "hf", "bf16")
    ds, hf = _tensors(tmp_path / "ds"), _tensors(tmp_path / "hf")
    mapped = {GEN["to_deepseek"](k): v for k, v in hf.items()}
    assert set(mapped) == {k for k in ds if not k.startswith("mtp.")}
    for k, v in mapped.items():
        assert torch.equal(ds[k].double(), v.double()), k
    assert ds[f"{EXPERT}.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("recipe", "opts"),
    [("bf16", ()), ("ascend-w8a8", ()), ("ascend-hybrid", ()),
     ("ascend-w4a16", ("--requantize",)), ("ascend-w4a8", ("--requantize",)),
     ("awq-w4a16", ("--requantize", "--group-size", "64")), ("ct-w4a16", ("--requantize",)),
     ("fp4", ("--requantize", "--fp4-layout", "nvfp4"))],
)  # fmt: skip
def test_every_recipe_converts_and_verifies(
    recipe: str, opts: tuple[str, ...], v4: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / recipe
    _convert(v4["deepseek"], out, recipe, *opts)
    art = open_artifact(out)
    # awq group 64: the tiny wo_b's 64 inputs do not split at TP2 (refused, valid tp sizes: 1)
    art.load(ParallelLayout(tp_size=1 if recipe == "awq-w4a16" else 2, tp_rank=0))
    groups = {g["name"]: g for g in read_json(out / "hetquant.json")["precision"]["groups"]}
    for kept in ("compressor", "indexer", "hyper_connections"):  # at source precision
        assert set(groups[kept]["format"].split("+")) <= {"BF16", "F32", "bf16"}, groups[kept]


@pytest.mark.parametrize("recipe", ["ascend-w4a16", "ascend-w4a8", "awq-w4a16", "ct-w4a16"])
def test_fp4_experts_not_requantized_unasked(
    recipe: str, v4: dict[str, Path], tmp_path: Path
) -> None:
    res = run_cli("convert", v4["deepseek"], tmp_path / "o", "--recipe", recipe)
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    line = res.stderr.strip().splitlines()[-1]
    assert "fp4_e2m1, a low-bit format" in line and "--requantize" in line


def test_fp4_recipe_repacks_the_experts_exactly(v4: dict[str, Path], tmp_path: Path) -> None:
    """``fp4`` without --requantize: every FP4 expert linear in NVFP4 with its codes as shipped,
    dequantizing to the source's values bit for bit; gate and up share one global scale
    (formats/linear_repack.py; the Ascend tiled layout: tests/formats/test_linear_repack.py, the
    tiny model's experts being too narrow to tile)."""
    out = tmp_path / "fp4"
    _convert(v4["deepseek"], out, "fp4", "--fp4-layout", "nvfp4")
    art, src = _tensors(out), _tensors(v4["deepseek"])
    nv, fp4 = get_format("nvfp4"), get_format("fp4_e2m1")
    experts = sorted({k.rpartition(".")[0] for k in src if ".ffn.experts." in k})
    assert experts and all(k.startswith(("layers.", "mtp.")) for k in experts)
    for name in experts:
        stored = {k: art[f"{name}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
        want = fp4.dequantize({"weight": src[f"{name}.weight"], "scale": src[f"{name}.scale"]})
        assert torch.equal(stored["weight"], src[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(nv.dequantize(stored).view(torch.int32), want.view(torch.int32)), name
        if name.endswith(".w1"):
            up = art[f"{name[:-1]}3.weight_scale_2"]
            assert torch.equal(stored["weight_scale_2"], up), name


def test_fp4_recipe_refuses_a_scale_spread_past_e4m3(v4: dict[str, Path], tmp_path: Path) -> None:
    """One expert's gate with a scale of 2^20 (its merged module then spans more powers of two
    than E4M3's 18): refused in one line naming it, unless --requantize."""
    scale = torch.full((64, 4), 127, dtype=torch.uint8)
    scale[3, 1] = 147
    bad = tmp_path / "bad"
    _corrupt(v4["deepseek"], bad, {f"{EXPERT}.scale": scale.view(torch.float8_e8m0fnu)})
    res = run_cli("convert", bad, tmp_path / "o", "--recipe", "fp4", "--fp4-layout", "nvfp4")
    line = res.stderr.strip()
    assert res.exit_code == 2 and len(line.splitlines()) == 1, line
    assert line.startswith(f"error: {EXPERT}.weight: its UE8M0 scale exponents span 2^"), line
    assert ".. 2^20 (" in line, line  # the merged module's (gate's and up's) joint span
    assert "over its merged module" in line and "--requantize" in line
    _convert(bad, tmp_path / "rq", "fp4", "--fp4-layout", "nvfp4", "--requantize")


def test_hybrid_keeps_fp4_experts_byte_for_byte(v4: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "hy"
    _convert(v4["deepseek"], out, "ascend-hybrid")
    assert read_json(out / "hetquant.json")["recipe"]["options"] == {}  # nothing re-quantized
    src = {}
    for f in v4["deepseek"].glob("*.safetensors"):
        src.update(load_file(f))
    layer = load_file(out / "cpu_experts" / "layer_001.safetensors")
    key = next(k for k in layer if k.endswith("gate_up_packed"))
    stem = key.rpartition(".")[0]
    gate, up = (
        src[f"{EXPERT}.weight"].view(torch.uint8),
        src["layers.1.ffn.experts.5.w3.weight"].view(torch.uint8),
    )
    assert torch.equal(layer[key][5][0::2], gate) and torch.equal(layer[key][5][1::2], up)
    scale = layer[f"{stem}.gate_up_scale"][5].view(torch.uint8)
    assert torch.equal(scale[0::2], src[f"{EXPERT}.scale"].view(torch.uint8))
    down = layer[f"{stem}.down_packed"][5]
    assert torch.equal(down, src["layers.1.ffn.experts.5.w2.weight"].view(torch.uint8))
    # the pool computes an expert as the exact int8 reference does, on every subpool split
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    gu = fp4_gemv_int8(layer[key][5], layer[f"{stem}.gate_up_scale"][5], x)
    act = torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]
    want = fp4_gemv_int8(down, layer[f"{stem}.down_scale"][5], act)
    # one expert: bit for bit on every split; split="inter" gathers the subpools' activations
    # before the down projection, whose rows the subpools share (formats/fp4_cpu.py,
    # ``subpool_down``), so a routed sum too is one pool's bits (split="experts" adds the
    # subpools' sums of their own experts: another order of the float32 additions)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(6)])  # 6 tokens, top-3
    w, xs = torch.rand(6, 3, generator=g), torch.randn(6, 128, generator=g)
    routed = []
    for subpools, split in ((1, "inter"), (2, "inter"), (2, "experts"), (4, "experts")):
        with open_artifact(out).cpu_expert_pool(subpools=subpools, split=split) as pool:
            assert torch.equal(pool.expert(1, 5, x), want), (subpools, split)
            routed.append(pool.forward(1, xs, ids, w))
    assert torch.equal(routed[1], routed[0])  # split along I: one pool's bits
    for y in routed[2:]:
        assert float((y - routed[0]).abs().max()) <= 1e-6 * float(routed[0].abs().max())


def _corrupt(src: Path, dst: Path, replace: dict[str, torch.Tensor]) -> None:
    """A copy of ``src`` with the stored tensors ``replace`` names swapped for its values."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for file in {index["weight_map"][n] for n in replace}:
        with safe_open(dst / file, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors.update({n: t for n, t in replace.items() if n in tensors})
        save_file(tensors, str(dst / file), metadata={"format": "pt"})


def _e8m0(shape: tuple[int, ...], byte: int = 127) -> torch.Tensor:
    return torch.full(shape, byte, dtype=torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize(
    ("replace", "match"),
    [  # packed codes and scales agree with each other, not with the config ([64, 128])
        ({f"{EXPERT}.weight": torch.zeros(64, 32, dtype=torch.int8), f"{EXPERT}.scale": _e8m0((64, 2))},
         rf"{EXPERT}\.weight is I8\[64, 32\], expected I8\[64, 64\]; {EXPERT}\.scale is "
         r"F8_E8M0\[64, 2\], expected F8_E8M0\[64, 4\] \(fp4_e2m1 of a \[64, 128\] weight"),
        ({f"{EXPERT}.weight": torch.zeros(64, 32, dtype=torch.int8)},  # codes disagree with scales
         rf"{EXPERT}: stored tensors \['scale', 'weight'\] fit no format"),
        ({f"{EXPERT}.scale": torch.ones(64, 4)},
         rf"{EXPERT}: stored tensors .* fit no format .*scale dtype F32 is not UE8M0"),
        ({f"{EXPERT}.scale": _e8m0((64, 4), 255)}, rf"{EXPERT}: scale: 256 NaN scale\(s\)"),
    ],
)  # fmt: skip
def test_bad_fp4_expert_is_one_line_and_nothing_written(
    replace: dict[str, torch.Tensor], match: str, v4: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    _corrupt(v4["deepseek"], bad, replace)
    res = run_cli("convert", bad, tmp_path / "o", "--recipe", "bf16")
    out = tmp_path / "o"  # nothing written but the in-progress marker of an execution-time error
    assert res.exit_code == 2 and (not out.exists() or os.listdir(out) == [".hetquant-partial"])
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: "), line
    assert re.search(match, line), line


@pytest.mark.parametrize(
    ("edit", "what"),
    [({"expert_dtype": "int4"}, "expert_dtype"),
     ({"layer_types": ["sliding_attention", "ring", "sliding_attention", "sliding_attention"],
       "compress_ratios": None}, "'ring' is a layer type hetquant does not know")],
)  # fmt: skip
def test_bad_config_refused_before_anything_is_written(
    edit: dict, what: str, v4: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(v4["deepseek"], bad)
    raw = {**json.loads((bad / "config.json").read_text()), **edit}
    (bad / "config.json").write_text(json.dumps(raw))
    res = run_cli("convert", bad, tmp_path / "o", "--recipe", "ascend-hybrid")
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    assert what in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_run_cli_on_the_bf16_artifact(v4: dict[str, Path], tmp_path: Path) -> None:
    """``hetquant run`` runs V4 (the reference forward: tests/runtime/forward/
    test_deepseek_v4_forward.py) and prints the generated ids."""
    out = tmp_path / "bf16"
    _convert(v4["deepseek"], out, "bf16")
    res = run_cli("run", out, "--tokens", "5,17,42,100,7,300,250,11", "--generate", "3")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip(), res.stdout


def test_mtp_layer_kept_or_dropped(v4: dict[str, Path], tmp_path: Path) -> None:
    """The MTP layer (``mtp.0.``) goes through the hybrid as any layer, or is left out."""
    for mtp, layers in (("keep", 5), ("drop", 4)):
        out = tmp_path / mtp
        _convert(v4["deepseek"], out, "ascend-hybrid", "--mtp", mtp)
        names = set(_tensors(out))
        assert any(n.startswith("mtp.0.") for n in names) == (mtp == "keep")
        assert len(list((out / "cpu_experts").glob("*.safetensors"))) == layers
        assert read_json(out / "config.json")["num_nextn_predict_layers"] == (mtp == "keep")
