"""The writer seam (convert/planning/containers.py): both containers' layouts, and a whole convert whose
routed experts go to headerless ``raw`` blobs — two workers, SIGKILL, resume, manifest, verify."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import raw_container_recipe
import torch
from support import (
    MANIFEST,
    PARTIAL,
    TINY,
    blake3_hex,
    read_json,
    st_header,
    tree_hashes,
    wait_for_jobs,
)

from hetquant.convert import RECIPES
from hetquant.convert.engine.writer import PieceWriter
from hetquant.convert.planning import containers
from hetquant.convert.planning.containers import (
    CONTAINERS,
    OutTensor,
    RawFile,
    SafetensorsFile,
    make_container,
)
from hetquant.formats import HetquantError, TensorMeta

TENSORS = [OutTensor("a", TensorMeta("I32", (2, 3))), OutTensor("b", TensorMeta("BF16", (5,)))]
CONVERT_DIR = Path(__file__).parent.parent  # raw_container_recipe.py lives there


def _filled(kind: str, tmp_path: Path) -> tuple[object, Path]:
    f = make_container(kind, "sub/x.bin", "p")
    f.tensors.extend(TENSORS)
    path = tmp_path / f.name
    f.create(path)
    w = PieceWriter([f], tmp_path)
    w.write("b", 2, torch.tensor([7, -1], dtype=torch.bfloat16))  # elements 1 and 2 of b
    w.write("a", 0, torch.arange(6, dtype=torch.int32).reshape(2, 3))
    w.close()
    return f, path


def test_raw_file_is_its_tensors_bytes_back_to_back(tmp_path: Path) -> None:
    f, path = _filled("raw", tmp_path)
    assert isinstance(f, RawFile) and f.header == b""
    assert f.offsets() == {"a": 0, "b": 24} and f.size == 34
    bf16 = torch.tensor([0, 7, -1, 0, 0], dtype=torch.bfloat16)
    want = torch.arange(6, dtype=torch.int32).numpy().tobytes() + bf16.view(torch.int16).numpy().tobytes()  # fmt: skip
    assert path.read_bytes() == want
    assert f.intact(path) and f.check(path) == []
    with path.open("r+b") as fh:
        fh.truncate(33)
    assert not f.intact(path)
    assert f.check(path) == ["sub/x.bin: size or header differs from the plan (raw, 34 bytes)"]


def test_safetensors_file_is_header_then_the_same_bytes(tmp_path: Path) -> None:
    f, path = _filled("safetensors", tmp_path)
    raw, raw_path = _filled("raw", tmp_path / "raw")
    start, header = st_header(path)
    assert isinstance(f, SafetensorsFile) and start == len(f.header)
    assert header["a"] == {"dtype": "I32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert f.offsets() == {"a": start, "b": start + 24} and f.size == start + raw.size
    assert path.read_bytes()[start:] == raw_path.read_bytes()
    assert f.intact(path) and f.check(path) == []
    with path.open("r+b") as fh:  # same length, other dtype: the header no longer matches
        fh.write(path.read_bytes()[:start].replace(b'"I32"', b'"F32"'))
    assert not f.intact(path)
    assert f.check(path) == ["sub/x.bin: header differs from the plan (tensor names, dtypes or shapes)"]  # fmt: skip


def test_layout_digest_tells_raw_layouts_apart() -> None:
    def raw(*tensors: OutTensor) -> RawFile:
        return RawFile("x", "p", list(tensors))

    a, b = TENSORS
    swapped = OutTensor("a", TensorMeta("F32", (2, 3)))  # same size, other dtype
    digests = {raw(a, b).layout_digest(), raw(b, a).layout_digest(), raw(swapped, b).layout_digest()}  # fmt: skip
    assert len(digests) == 3
    assert raw(a, b).layout_digest() == raw(a, b).layout_digest()


def test_unknown_container_is_refused() -> None:
    assert set(CONTAINERS) == {"safetensors", "raw"}
    with pytest.raises(HetquantError, match="unknown container 'gguf'; known: raw, safetensors"):
        make_container("gguf", "x", "p")


def test_allocate_falls_back_to_a_sparse_file(tmp_path: Path, monkeypatch) -> None:
    """A filesystem without fallocate (EOPNOTSUPP) still gets a file of the planned size."""

    def unsupported(fd: int, mode: int, offset: int, size: int) -> int:
        import ctypes

        ctypes.set_errno(95)  # EOPNOTSUPP
        return -1

    monkeypatch.setattr(containers, "_FALLOCATE", unsupported)
    f, path = _filled("raw", tmp_path)
    assert path.stat().st_size == f.size and f.intact(path)


# ----------------------------------------------------------------------------------------------
# a whole convert through the raw container


@pytest.fixture
def raw_recipe(monkeypatch: pytest.MonkeyPatch):
    recipe = raw_container_recipe.recipe()
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    return recipe


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from support import run_cli

    out = tmp_path_factory.mktemp("hybrid") / "out"
    res = run_cli("convert", TINY, out, "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    return out


SETUP = f"import sys; sys.path.insert(0, {str(CONVERT_DIR)!r}); import raw_container_recipe; raw_container_recipe.register()"  # fmt: skip


def test_raw_experts_two_workers_killed_resume_manifest_verify(
    cli, hetquant_proc, raw_recipe, hybrid: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["convert", TINY, out, "--recipe", raw_recipe.name, "--workers", "2"]
    proc = hetquant_proc(args, slow_jobs=0.2, setup=SETUP)
    wait_for_jobs(proc, out, 8)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole convert: its workers too
    proc.wait()
    assert not (out / MANIFEST).exists()
    assert sorted((out / PARTIAL / "raw_experts").iterdir())  # raw files were being written

    res = cli(*args)  # the same command resumes, with two workers again
    assert res.exit_code == 0, res.stderr
    assert "already done" in res.stderr

    # each raw blob holds exactly the data section of the hybrid's safetensors expert file
    manifest = read_json(out / MANIFEST)
    raw_files = manifest["parts"]["raw_experts"]["files"]
    st_files = read_json(hybrid / MANIFEST)["parts"]["cpu_experts"]["files"]
    assert len(raw_files) == len(st_files) > 1
    for raw, st in zip(sorted(raw_files), sorted(st_files), strict=True):
        start, _ = st_header(hybrid / st)
        assert (out / raw).read_bytes() == (hybrid / st).read_bytes()[start:], raw
        assert manifest["files"][raw] == {"size": (out / raw).stat().st_size, "blake3": blake3_hex(out / raw)}  # fmt: skip
    # ... and the root part is the hybrid's, byte for byte
    mine, theirs = tree_hashes(out), tree_hashes(hybrid)
    root = {k for k in theirs if not k.startswith("cpu_experts/") and k != MANIFEST}
    assert {k: mine[k] for k in root} == {k: theirs[k] for k in root}
    assert set(mine) == root | set(raw_files) | {MANIFEST}

    res = cli("verify", out)
    assert res.exit_code == 0, res.stdout
    blob = out / raw_files[0]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    res = cli("verify", out)
    assert res.exit_code == 1 and f"FAIL {raw_files[0]}: blake3 differs" in res.stdout
    blob.write_bytes(bytes(data[:-1]))
    res = cli("verify", out)
    assert res.exit_code == 1
    assert f"FAIL {raw_files[0]}: size or header differs from the plan (raw," in res.stdout
