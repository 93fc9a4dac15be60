"""``hetquant export --to kt-mxfp4``: a DeepSeek-V4 hybrid's FP4 experts (``fp4_cpu_experts``) back
in DeepSeek's own per-expert tensors, byte for byte — the golden bytes are the checkpoint's —
which is what kt-kernel 0.7.2's ``MXFP4`` method reads (``MXFP4SafeTensorLoader``,
``kt_kernel/utils/loader.py:1198-1309``; its reading is emulated here and must give the pool's
weights exactly); and the refusals."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import REPO, run_cli

from hetquant.convert.export import exporters
from hetquant.convert.export.exporters import ExpertLayer
from hetquant.formats.fp4_cpu import LAYER_KEYS, dequantize_expert
from hetquant.formats.fp4_e2m1 import E2M1, unpack_e2m1

GEN = runpy.run_path(str(REPO / "examples" / "tiny-deepseek-v4" / "make_tiny.py"))


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(DeepSeek-layout V4 source, its ascend-hybrid artifact: FP4 CPU experts)."""
    base = tmp_path_factory.mktemp("v4-kt")
    src = GEN["write_checkpoint"](base / "src", "deepseek")
    res = run_cli("convert", src, base / "hybrid", "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    return src, base / "hybrid"


def _export(art: Path, out: Path, cli) -> list[Path]:
    res = cli("export", art, out, "--to", "kt-mxfp4")
    assert res.exit_code == 0, res.stderr
    assert cli("verify", out).exit_code == 0
    return sorted(out.glob("*.safetensors"))


def test_the_export_is_the_checkpoints_expert_tensors(v4, tmp_path, cli) -> None:
    src, art = v4
    files = _export(art, tmp_path / "kt", cli)
    layers = sorted((art / "cpu_experts").glob("*.safetensors"))
    assert [f.name for f in files] == [f.name for f in layers]
    source: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        source |= load_file(str(f))
    want = {k: v for k, v in source.items() if ".ffn.experts." in k}  # w1/w2/w3 weight, scale
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got |= load_file(str(f))
    assert sorted(got) == sorted(want) and any(k.startswith("mtp.") for k in got)
    for name, t in got.items():
        assert t.dtype == want[name].dtype and t.shape == want[name].shape, name
        assert torch.equal(t.view(torch.uint8), want[name].view(torch.uint8)), name


def _kt_bf16_scale(scale: torch.Tensor) -> torch.Tensor:
    """kt's ``MXFP4SafeTensorLoader._ue8m0_to_bf16`` (loader.py:1236-1249): byte ``e`` → bf16
    bits ``e << 7`` (0x0040, the subnormal 2^-127, for e = 0)."""
    e = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x40), e << 7)
    return bits.to(torch.int16).view(torch.bfloat16)


def test_kt_reads_the_pools_weights(v4, tmp_path, cli) -> None:
    """kt's reading of the files (its key lookup for ``model.layers.{L}`` with ``model.`` stripped,
    codes viewed as U8, scales through its bf16 shift) dequantizes to the artifact's experts."""
    _, art = v4
    files = _export(art, tmp_path / "kt", cli)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    checked = 0
    for f, layer_file in zip(
        files, sorted((art / "cpu_experts").glob("*.safetensors")), strict=True
    ):
        kt = load_file(str(f))
        layer = load_file(str(layer_file))
        prefix = next(iter(layer)).rsplit(".", 1)[0]
        layer = {k: layer[f"{prefix}.{k}"] for k in LAYER_KEYS}
        base = prefix.removesuffix(".ffn.experts")
        for e in range(layer["gate_up_packed"].shape[0]):
            pool = dict(zip(("w1", "w3", "w2"), dequantize_expert(layer, e), strict=True))
            for w, want in pool.items():
                codes = kt[f"{base}.ffn.experts.{e}.{w}.weight"].view(torch.uint8)
                s = _kt_bf16_scale(kt[f"{base}.ffn.experts.{e}.{w}.scale"]).float()
                deq = lut[unpack_e2m1(codes).long()] * s.repeat_interleave(32, dim=1)
                assert torch.equal(deq, want), (f.name, e, w)
                checked += 1
    assert checked == 3 * 8 * len(files)


def test_convert_is_a_repack() -> None:
    """One expert: gate = even rows of gate_up, up = odd rows, as I8 bytes; scales as stored."""
    layer = ExpertLayer(7, "cpu_experts/layer_007.safetensors", "layers.7.ffn.experts",
                        "fp4_cpu_experts", num_experts=2, hidden=64, inter=32)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    expert = {
        "gate_up_packed": torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=g),
        "gate_up_scale": torch.randint(0, 255, (64, 2), dtype=torch.uint8, generator=g),
        "down_packed": torch.randint(0, 256, (64, 16), dtype=torch.uint8, generator=g),
        "down_scale": torch.randint(0, 255, (64, 1), dtype=torch.uint8, generator=g),
    }
    expert = {k: v.view(torch.float8_e8m0fnu) if "scale" in k else v for k, v in expert.items()}
    x = exporters.get_exporter("kt-mxfp4")
    outs = x.outputs(layer, 1, 1)
    assert [(o.file, o.tensor, o.meta.dtype, o.meta.shape) for o in outs] == [
        ("layer_007.safetensors", "layers.7.ffn.experts.1.w1.weight", "I8", (32, 32)),
        ("layer_007.safetensors", "layers.7.ffn.experts.1.w1.scale", "F8_E8M0", (32, 2)),
        ("layer_007.safetensors", "layers.7.ffn.experts.1.w3.weight", "I8", (32, 32)),
        ("layer_007.safetensors", "layers.7.ffn.experts.1.w3.scale", "F8_E8M0", (32, 2)),
        ("layer_007.safetensors", "layers.7.ffn.experts.1.w2.weight", "I8", (64, 16)),
        ("layer_007.safetensors", "layers.7.ffn.experts.1.w2.scale", "F8_E8M0", (64, 1)),
    ]
    got = x.convert(layer, 1, expert)
    assert {o.key for o in outs} == set(got)
    raw = {k: v.view(torch.uint8) for k, v in expert.items()}
    assert torch.equal(got["gate/weight"].view(torch.uint8), raw["gate_up_packed"][0::2])
    assert torch.equal(got["up/weight"].view(torch.uint8), raw["gate_up_packed"][1::2])
    assert torch.equal(got["up/scale"].view(torch.uint8), raw["gate_up_scale"][1::2])
    assert torch.equal(got["down/weight"].view(torch.uint8), raw["down_packed"])
    assert (
        got["gate/weight"].dtype == torch.int8 and got["down/scale"].dtype == torch.float8_e8m0fnu
    )


def _refused(cli, args, out: Path, match: str) -> None:
    res = cli("export", *args)
    assert res.exit_code == 2, res.stdout
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
    assert match in res.stderr, res.stderr
    assert not out.exists()  # nothing written


def test_bad_input(v4, tiny_hybrid, tmp_path, cli) -> None:
    out = tmp_path / "kt"
    _refused(cli, [v4[1], out, "--to", "kt-mxfp4", "--numa", "2"], out,
             "--numa 2: kt-kernel 0.7.2 hands MXFP4 experts")  # fmt: skip
    _refused(cli, [v4[1], out, "--to", "kt-amxint4"], out, "use --to kt-mxfp4")
    _refused(cli, [tiny_hybrid, out, "--to", "kt-mxfp4"], out, "use --to kt-amxint4")
