"""``hetquant export``: the CPU experts in kt-kernel's layouts, lossless, through the engine.

AMXINT4 files are decoded with ``tests/kt_reference.py`` (byte positions from the decoded layout
of reference/cpu_experts.md §7.1, element by element) and compared with the artifact's codes and
scales; RAWINT4 files with the Kimi K2 Thinking source's own compressed-tensors tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kt_reference import decode_quant
from safetensors.torch import load_file
from support import hf_cache_snapshot, make_kimi_k2

from hetquant.convert.export import export, exporters
from hetquant.formats import HetquantError
from hetquant.formats.bits import unpack_nibbles_u8
from hetquant.formats.int4_cpu import LAYER_KEYS


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid: Path) -> Path:
    return tiny_hybrid


@pytest.fixture(scope="module")
def k2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(Kimi K2 Thinking source, its ascend-hybrid artifact: group-32 CPU experts)."""
    from hetquant.convert import SourceCheckpoint, convert, get_recipe

    base = tmp_path_factory.mktemp("k2")
    src = make_kimi_k2(base / "src", "thinking")
    convert(SourceCheckpoint.open(src), base / "art", get_recipe("ascend-hybrid"), max_shard_size=1 << 40)  # fmt: skip
    return src, base / "art"


def _layers(art: Path) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for f in sorted((art / "cpu_experts").glob("*.safetensors")):
        t = load_file(str(f))
        prefix = next(iter(t)).rsplit(".", 1)[0]
        out[int(prefix.split("layers.")[1].split(".")[0])] = {k: t[f"{prefix}.{k}"] for k in LAYER_KEYS}  # fmt: skip
    return out


def _expected_amx(layer: dict[str, torch.Tensor], e: int, numa: int) -> dict[str, tuple]:
    """File key → (codes [n, k] as offset binary, scale × 16) each slice must hold."""
    gu, gus = layer["gate_up_packed"][e], layer["gate_up_scale"][e]
    mats = {"gate": (gu[0::2], gus[0::2]), "up": (gu[1::2], gus[1::2]),
            "down": (layer["down_packed"][e], layer["down_scale"][e])}  # fmt: skip
    out = {}
    for proj, (packed, s) in mats.items():
        codes = unpack_nibbles_u8(packed)
        for part in range(numa):
            if proj == "down":
                i = codes.shape[1] // numa
                out[part, proj] = (codes[:, part * i : (part + 1) * i], s)
            else:
                i = codes.shape[0] // numa
                out[part, proj] = (codes[part * i : (part + 1) * i], s[part * i : (part + 1) * i])
    return out


@pytest.mark.parametrize("numa", [1, 2])
def test_amxint4_is_the_artifacts_codes_and_scales(hybrid, tmp_path, cli, numa) -> None:
    out = tmp_path / "kt"
    res = cli("export", hybrid, out, "--to", "kt-amxint4", "--numa", numa)
    assert res.exit_code == 0, res.stderr
    layers = _layers(hybrid)
    want_files = {"hetquant.json"}
    for num, layer in layers.items():
        for e in range(layer["gate_up_packed"].shape[0]):
            for (part, proj), (codes, s) in _expected_amx(layer, e, numa).items():
                n, k = codes.shape
                d = out / f"_layer_{num}" / f"_numa_{part}"
                quant = d / f"INT4_{proj}_{e}_{n * k // 2}Byte_quant_.kt"
                scale = d / f"INT4_{proj}_{e}_{4 * n}Byte_scale_.kt"
                want_files |= {str(quant.relative_to(out)), str(scale.relative_to(out))}
                assert torch.equal(decode_quant(quant.read_bytes(), n, k), codes)
                d16 = torch.frombuffer(bytearray(scale.read_bytes()), dtype=torch.float32) * 16
                assert torch.equal(d16, s)  # d = s / 16, exactly
    got = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert got == want_files
    assert cli("verify", out).exit_code == 0
    shown = cli("inspect", out)
    assert shown.exit_code == 0 and f"kt-amxint4, {numa} NUMA slice(s)" in shown.stdout


def test_amxint4_verify_resume_and_rerun(hybrid, tmp_path, cli, monkeypatch) -> None:
    clean = tmp_path / "clean"
    assert cli("export", hybrid, clean, "--to", "kt-amxint4").exit_code == 0
    out = tmp_path / "kt"
    real, calls = exporters.KtAmxInt4.convert, []

    def dies_after_five(self, *args):
        calls.append(1)
        if len(calls) > 5:
            raise HetquantError("killed")
        return real(self, *args)

    monkeypatch.setattr(exporters.KtAmxInt4, "convert", dies_after_five)
    with pytest.raises(HetquantError, match="killed"):
        export(hybrid, out, "kt-amxint4")
    assert not (out / "hetquant.json").exists()  # an interrupted export never looks complete
    journal = (out / ".hetquant-partial" / "journal").read_text().splitlines()
    assert len(journal) == 1 + 5
    monkeypatch.setattr(exporters.KtAmxInt4, "convert", real)
    calls.clear()
    res = cli("export", hybrid, out, "--to", "kt-amxint4")
    assert res.exit_code == 0, res.stderr
    manifest = json.loads((out / "hetquant.json").read_text())
    assert manifest["files"] == json.loads((clean / "hetquant.json").read_text())["files"]
    assert manifest["export"]["to"] == "kt-amxint4" and manifest["export"]["numa"] == 1
    again = cli("export", hybrid, out, "--to", "kt-amxint4")
    assert again.exit_code == 0 and "already complete" in again.stdout
    other = cli("export", hybrid, out, "--to", "kt-amxint4", "--numa", "2")
    assert other.exit_code == 2 and "--overwrite" in other.stderr
    # verify: a changed byte and a missing file are failed checks
    victim = next(out.glob("_layer_1/_numa_0/INT4_down_3_*quant_.kt"))
    data = bytearray(victim.read_bytes())
    data[7] ^= 1
    victim.write_bytes(bytes(data))
    res = cli("verify", out)
    assert res.exit_code == 1 and "blake3 differs" in res.stdout
    victim.unlink()
    res = cli("verify", out)
    assert res.exit_code == 1 and "missing" in res.stdout


def test_rawint4_is_the_sources_compressed_tensors(k2, tmp_path, cli) -> None:
    src, art = k2
    out = tmp_path / "raw"
    res = cli("export", art, out, "--to", "kt-rawint4")
    assert res.exit_code == 0, res.stderr
    assert cli("verify", out).exit_code == 0
    source = {}
    for f in src.glob("*.safetensors"):
        source |= load_file(str(f))
    files = sorted(out.glob("*.safetensors"))
    assert [f.name for f in files] == [f"layer_{n:03d}.safetensors" for n in _layers(art)]
    checked = 0
    for f in files:
        for name, t in load_file(str(f)).items():
            want = source[name]
            assert t.dtype == want.dtype or name.endswith("weight_shape")
            assert torch.equal(t.to(want.dtype), want), name  # the shipped codes and scales
            checked += 1
    assert checked == sum(1 for n in source if ".mlp.experts." in n and "weight_" in n)


def _refused(cli, args, out: Path, match: str) -> None:
    res = cli("export", *args)
    assert res.exit_code == 2, res.stdout
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
    assert match in res.stderr, res.stderr
    assert not out.exists()  # nothing written


def test_bad_input(hybrid, k2, tiny_artifact, tmp_path, cli) -> None:
    out = tmp_path / "kt"
    _refused(cli, [tiny_artifact, out, "--to", "kt-amxint4"], out, "no cpu_experts part")
    _refused(cli, [hybrid, out, "--to", "kt-amxint4", "--numa", "3"], out,
             "--numa 3 does not divide the moe intermediate size 256")  # fmt: skip
    _refused(cli, [hybrid, out, "--to", "kt-amxint4", "--numa", "4"], out,
             "down slice [H, I/4]: [256, 64] does not fit kt-kernel's AMXINT4 layout")  # fmt: skip
    _refused(cli, [hybrid, out, "--to", "kt-rawint4"], out, "use --to kt-amxint4")
    _refused(cli, [k2[1], out, "--to", "kt-amxint4"], out, "use --to kt-rawint4")
    _refused(cli, [k2[1], out, "--to", "kt-rawint4", "--numa", "2"], out,
             "RAWINT4 with --kt-threadpool-count 1 only")  # fmt: skip
    _refused(cli, [tmp_path / "nope", out, "--to", "kt-amxint4"], out, "no such file")
    res = cli("export", hybrid, out, "--to", "gguf")
    assert res.exit_code == 2 and "kt-amxint4" in res.stderr


def test_export_from_the_hub_cache(hybrid, tmp_path, cli) -> None:
    """A hybrid downloaded the normal way (every file a link into ``blobs/``) was refused
    ("points outside the artifact"); it exports the same files as the directory it came from."""
    snap = hf_cache_snapshot(hybrid, tmp_path / "hub")
    got, want = tmp_path / "from-cache", tmp_path / "from-dir"
    for src, out in ((snap, got), (hybrid, want)):
        res = cli("export", src, out, "--to", "kt-amxint4")
        assert res.exit_code == 0, res.stderr
    files = json.loads((got / "hetquant.json").read_text())["files"]
    assert files == json.loads((want / "hetquant.json").read_text())["files"]
    assert cli("verify", got).exit_code == 0


def test_export_into_the_artifact_is_refused(hybrid, tmp_path, cli) -> None:
    art = tmp_path / "art"
    shutil.copytree(hybrid, art)
    res = cli("export", art, art / "kt", "--to", "kt-amxint4")
    assert res.exit_code == 2 and "inside SOURCE" in res.stderr
