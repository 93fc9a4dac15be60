"""Bad input through ``hetquant convert``: exit 2, one ``error: …`` line naming the culprit, no
traceback, nothing in OUTPUT that looks like an artifact, and the source untouched."""

from __future__ import annotations

import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import (
    INDEX,
    MANIFEST,
    PARTIAL,
    edit_index,
    read_json,
    resave_shard,
    rewrite_header,
    shard_of,
    tree_hashes,
    write_json,
)

from hetquant.formats.fp8_block_rows import absmax_dequantized

SHARD1, SHARD2, SHARD3, SHARD5 = (f"model-0000{i}-of-000005.safetensors" for i in (1, 2, 3, 5))
KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [160, 256]: scale in SHARD2
O_PROJ = "model.layers.1.self_attn.o_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
ROUTER = "model.layers.1.mlp.gate.weight"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def assert_refused(res, src: Path, out: Path, before: dict[str, str], *needles: str) -> str:
    """The contract for bad input; returns the error line."""
    assert res.exception is None, repr(res.exception)
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("error: ")
    assert "Traceback" not in res.stderr + res.stdout
    for needle in needles:
        assert needle in line, (needle, line)
    assert tree_hashes(src) == before, "the source changed"
    if out.exists():
        assert not (out / MANIFEST).exists()
        assert {p.name for p in out.iterdir()} <= {PARTIAL}
    return line


def _set(name: str, fn: Callable[[torch.Tensor], None]) -> Callable[[Path], None]:
    """A corruption that edits tensor ``name`` in its shard (re-saved with safetensors)."""

    def corrupt(src: Path) -> None:
        def mutate(tensors: dict[str, torch.Tensor]) -> None:
            fn(tensors[name])

        resave_shard(shard_of(src, name), mutate)

    return corrupt


def _fp8_code(code: int) -> Callable[[torch.Tensor], None]:
    def fn(t: torch.Tensor) -> None:
        t.view(torch.uint8)[150, 3] = code  # in the partial block row of kv_a (rows 128..159)

    return fn


def _value(idx: tuple[int, ...], v: float) -> Callable[[torch.Tensor], None]:
    def fn(t: torch.Tensor) -> None:
        t[idx] = v

    return fn


def _drop_scale(src: Path) -> None:
    scale = KV_A + "_scale_inv"
    resave_shard(src / SHARD2, lambda t: t.pop(scale))
    edit_index(src, lambda d: d["weight_map"].pop(scale))


def _scale_shape(src: Path) -> None:
    scale = KV_A + "_scale_inv"  # [2, 2] → [1, 2]: the partial block row forgotten

    def mutate(t: dict[str, torch.Tensor]) -> None:
        t[scale] = t[scale][:1].clone()

    resave_shard(src / SHARD2, mutate)


def _scale_dtype(src: Path) -> None:
    scale = KV_A + "_scale_inv"

    def mutate(t: dict[str, torch.Tensor]) -> None:
        t[scale] = t[scale].to(torch.bfloat16)

    resave_shard(src / SHARD2, mutate)


def _truncate(file: str, keep: int | Callable[[int], int]) -> Callable[[Path], None]:
    def corrupt(src: Path) -> None:
        path = src / file
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.truncate(keep if isinstance(keep, int) else keep(size))

    return corrupt


def _offsets_past_end(src: Path) -> None:
    """The last tensor of shard 3 moved one tensor-length past the data, header length kept."""

    def mutate(h: dict) -> None:
        name = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [e, 2 * e - b]

    rewrite_header(src / SHARD3, mutate)


def _header_dtype(src: Path) -> None:
    def mutate(h: dict) -> None:
        h[NORM]["dtype"] = "BF17"

    rewrite_header(src / SHARD1, mutate)


def _header_offsets_strings(src: Path) -> None:
    def mutate(h: dict) -> None:
        h.pop("__metadata__")  # makes room for the quotes
        h[NORM]["data_offsets"] = [str(x) for x in h[NORM]["data_offsets"]]

    rewrite_header(src / SHARD1, mutate)


def _index_file(tensor: str, file: str) -> Callable[[Path], None]:
    def corrupt(src: Path) -> None:
        edit_index(src, lambda d: d["weight_map"].__setitem__(tensor, file))

    return corrupt


def _outside_shard(rel: Callable[[Path], str]) -> Callable[[Path], None]:
    """The index points O_PROJ's shard outside SOURCE, at a real, valid copy of that shard."""

    def corrupt(src: Path) -> None:
        outside = src.parent / "x.safetensors"
        shutil.copyfile(shard_of(src, O_PROJ), outside)
        _index_file(O_PROJ, rel(src))(src)

    return corrupt


def _index_extra_tensor(src: Path) -> None:
    edit_index(src, lambda d: d["weight_map"].__setitem__("model.layers.0.ghost.weight", SHARD1))


def _config(mutate: Callable[[dict], None]) -> Callable[[Path], None]:
    def corrupt(src: Path) -> None:
        cfg = read_json(src / "config.json")
        mutate(cfg)
        write_json(src / "config.json", cfg)

    return corrupt


def _text(file: str, text: str) -> Callable[[Path], None]:
    def corrupt(src: Path) -> None:
        (src / file).write_text(text)

    return corrupt


def _remove(file: str) -> Callable[[Path], None]:
    return lambda src: (src / file).unlink()


def _fifo(file: str) -> Callable[[Path], None]:
    """``file`` replaced by a FIFO: opened for reading, it would block until a writer came."""

    def corrupt(src: Path) -> None:
        (src / file).unlink()
        os.mkfifo(src / file)

    return corrupt


def _link_out(file: str) -> Callable[[Path], None]:
    """``file`` a link to a valid copy of itself outside SOURCE."""

    def corrupt(src: Path) -> None:
        outside = src.parent / f"elsewhere-{file}"
        shutil.move(src / file, outside)
        os.symlink(outside, src / file)

    return corrupt


# (id, corruption, substrings the error line must contain)
CASES: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    ("truncated-shard-end", _truncate(SHARD3, lambda n: n - 1), (SHARD3, "truncated")),
    ("truncated-shard-half", _truncate(SHARD3, lambda n: n // 2), (SHARD3,)),
    ("truncated-shard-in-header", _truncate(SHARD3, 100), (SHARD3, "header length")),
    ("truncated-shard-4-bytes", _truncate(SHARD3, 4), (SHARD3, "only 4 bytes")),
    ("truncated-shard-empty", _truncate(SHARD5, 0), (SHARD5, "only 0 bytes")),
    ("header-offsets-past-end", _offsets_past_end, (SHARD3, "past the end")),
    ("header-unknown-dtype", _header_dtype, (SHARD1, NORM, "BF17")),
    ("header-offsets-strings", _header_offsets_strings, (SHARD1, NORM)),
    ("index-missing-shard-file", _remove(SHARD2), (INDEX, SHARD2, "does not exist")),
    ("index-names-absent-shard", _index_file(O_PROJ, "model-00009-of-000005.safetensors"),
     ("model-00009-of-000005.safetensors", O_PROJ)),
    ("index-dotdot-path", _outside_shard(lambda s: "../x.safetensors"),
     (INDEX, "../x.safetensors", "outside")),
    ("index-absolute-path", _outside_shard(lambda s: str(s.parent / "x.safetensors")),
     (INDEX, "x.safetensors", "outside")),
    ("shard-is-a-fifo", _fifo(SHARD3), (SHARD3, "is a FIFO", "not a regular file")),
    ("config-is-a-fifo", _fifo("config.json"), ("config.json", "is a FIFO")),
    ("shard-links-outside", _link_out(SHARD3), (INDEX, SHARD3, "is a link to", "outside")),
    ("index-tensor-not-in-shard", _index_file(O_PROJ, SHARD1), (O_PROJ, SHARD1)),
    ("index-unknown-tensor", _index_extra_tensor, ("model.layers.0.ghost.weight",)),
    ("fp8-without-scale", _drop_scale, (KV_A, "_scale_inv")),
    ("scale-wrong-shape", _scale_shape, (KV_A + "_scale_inv", "[1, 2]", "[2, 2]")),
    ("scale-wrong-dtype", _scale_dtype, (KV_A + "_scale_inv", "BF16")),
    ("scale-nan", _set(KV_A + "_scale_inv", _value((1, 1), math.nan)), (KV_A + "_scale_inv", "NaN")),
    ("scale-inf", _set(KV_A + "_scale_inv", _value((0, 1), math.inf)), (KV_A + "_scale_inv",)),
    ("scale-negative", _set(KV_A + "_scale_inv", _value((1, 0), -0.5)), (KV_A + "_scale_inv", "negative scale")),
    ("scale-overflows-bf16", _set(KV_A + "_scale_inv", _value((1, 1), 3e38)), (KV_A + "_scale_inv", "overflow BF16")),
    ("fp8-nan-0x7f", _set(KV_A, _fp8_code(0x7F)), (KV_A, "NaN")),
    ("fp8-nan-0xff", _set(KV_A, _fp8_code(0xFF)), (KV_A, "NaN")),
    ("bf16-nan", _set(NORM, _value((5,), math.nan)), (NORM, "NaN")),
    ("bf16-inf", _set(EMBED, _value((3, 4), math.inf)), (EMBED, "Inf")),
    ("bf16-neg-inf", _set(ROUTER, _value((0, 0), -math.inf)),
     (ROUTER,)),
    ("f32-bias-nan", _set(BIAS, _value((2,), math.nan)), (BIAS,)),
    ("shape-disagrees-with-config", _config(lambda c: c.update(intermediate_size=c["intermediate_size"] + 128)),
     ("model.layers.0.mlp.gate_proj.weight", "config.json")),
    ("config-missing-fields", _config(lambda c: [c.pop("hidden_size"), c.pop("kv_lora_rank")]),
     ("config.json", "hidden_size", "kv_lora_rank")),
    ("config-field-wrong-type", _config(lambda c: c.update(num_hidden_layers="3")),
     ("config.json", "num_hidden_layers")),
    ("config-no-model-type", _config(lambda c: c.pop("model_type")),
     ("config.json", "no model_type", "deepseek_v3")),
    ("config-unknown-model-type", _config(lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])),
     ("config.json", "'llama'", "LlamaForCausalLM", "deepseek_v3")),
    ("config-invalid-json", _text("config.json", '{"hidden_size": 256,'), ("config.json", "JSON")),
    ("config-not-object", _text("config.json", "[1, 2]"), ("config.json",)),
    ("config-absent", _remove("config.json"), ("config.json",)),
    ("index-invalid-json", _text(INDEX, '{"weight_map": {'), (INDEX, "JSON")),
    ("index-no-weight-map", _text(INDEX, '{"metadata": {}}'), (INDEX, "weight_map")),
    ("index-and-single-file-absent", _remove(INDEX), (INDEX,)),
]  # fmt: skip


@pytest.mark.parametrize(("corrupt", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_corrupt_source_is_refused(
    cli, tiny_src: Path, tmp_path: Path, corrupt: Callable[[Path], None], needles: tuple[str, ...]
) -> None:
    corrupt(tiny_src)
    before = tree_hashes(tiny_src)
    out = tmp_path / "out"
    res = cli("convert", tiny_src, out, "--recipe", "bf16")
    assert_refused(res, tiny_src, out, before, *needles)


def test_fp4_refuses_a_nan_code_its_absmax_does_not_read(cli, tiny_src: Path, tmp_path: Path) -> None:  # fmt: skip
    """fp4's per-tensor amax reads only the FP8 blocks that can hold it (``fp8_absmax``): a NaN
    code in a block whose bound lies below the weight's maximum is not seen there, and the
    dequantizing pass still refuses it, naming the weight, in the pool's workers too."""
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"

    def mutate(tensors: dict[str, torch.Tensor]) -> None:
        codes, scale = tensors[name].view(torch.uint8), tensors[name + "_scale_inv"]
        bounds = (448.0 * scale).to(torch.bfloat16).float()  # [rows / 128, cols / 128]
        i, j = divmod(int(bounds.argmin()), scale.shape[1])
        assert float(bounds[i, j]) < absmax_dequantized(tensors[name], scale), "pick another"
        codes[i * 128, j * 128] = 0xFF

    resave_shard(shard_of(tiny_src, name), mutate)
    before = tree_hashes(tiny_src)
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        res = cli("convert", tiny_src, out, "--recipe", "fp4", "--workers", workers)
        assert_refused(res, tiny_src, out, before, name, "NaN")


def test_header_rewrite_helper_keeps_the_length(tiny_src: Path) -> None:
    """The in-place header edit used above changes only header bytes, never the data."""
    path = tiny_src / SHARD3
    raw = path.read_bytes()
    _offsets_past_end(tiny_src)
    new = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert len(new) == len(raw) and new[:8] == raw[:8] and new[8 + n :] == raw[8 + n :]
    assert new[8 : 8 + n] != raw[8 : 8 + n]


def test_bad_input_real_process_stderr_is_one_line(hetquant_proc, tiny_src: Path, tmp_path):
    """End to end, outside CliRunner: a NaN met mid-run gives one stderr line and exit 2."""
    _set(NORM, _value((5,), math.nan))(tiny_src)
    before = tree_hashes(tiny_src)
    out = tmp_path / "out"
    proc = hetquant_proc(["convert", tiny_src, out, "--recipe", "bf16"])
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert stderr.splitlines() == [stderr.strip()] and stderr.startswith(f"error: {NORM}: ")
    assert stdout == ""
    assert tree_hashes(tiny_src) == before
    assert not (out / MANIFEST).exists()


def test_verbose_shows_the_traceback(cli, tiny_src: Path, tmp_path: Path) -> None:
    _remove("config.json")(tiny_src)
    res = cli("-v", "convert", tiny_src, tmp_path / "out", "--recipe", "bf16")
    assert res.exit_code == 2
    assert "Traceback" in res.stderr and res.stderr.rstrip().splitlines()[-1].startswith("error: ")


# ----------------------------------------------------------------------------------------------
# OUTPUT and options


def test_output_non_empty_foreign_dir_is_refused_even_with_overwrite(
    cli, tiny_src: Path, tmp_path: Path
) -> None:
    """--overwrite replaces an artifact (or an interrupted convert); it never deletes a directory
    that hetquant did not create."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before_src, before_out = tree_hashes(tiny_src), tree_hashes(out)
    for extra in ([], ["--overwrite"]):
        res = cli("convert", tiny_src, out, "--recipe", "bf16", *extra)
        assert_refused(res, tiny_src, tmp_path / "none", before_src, str(out))
        assert tree_hashes(out) == before_out
    assert "not empty" in res.stderr


def test_output_empty_dir_is_fine(cli, tiny_src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert cli("convert", tiny_src, out, "--recipe", "bf16").exit_code == 0
    assert (out / MANIFEST).exists()


def test_output_holding_an_artifact_needs_overwrite(
    cli, tiny_src: Path, artifact_copy: Path
) -> None:
    before_src, before_out = tree_hashes(tiny_src), tree_hashes(artifact_copy)
    (artifact_copy / "stray.txt").write_text("x")  # the user's: --overwrite keeps it
    res = cli("convert", tiny_src, artifact_copy, "--recipe", "bf16")
    assert_refused(res, tiny_src, artifact_copy.parent / "none", before_src, "already holds an artifact", "--overwrite")  # fmt: skip
    assert (artifact_copy / "stray.txt").exists()
    res = cli("convert", tiny_src, artifact_copy, "--recipe", "bf16", "--overwrite")
    assert res.exit_code == 0, res.stderr
    after = tree_hashes(artifact_copy)
    assert (artifact_copy / "stray.txt").read_text() == "x"
    del after["stray.txt"]
    assert after.keys() == before_out.keys()
    assert {k for k in after if after[k] != before_out[k]} == {MANIFEST}  # source path differs
    assert tree_hashes(tiny_src) == before_src


@pytest.mark.parametrize("where", ["sub", "same", "parent"])
def test_output_inside_source_or_source_inside_output(cli, tiny_src: Path, where: str) -> None:
    before = tree_hashes(tiny_src)
    out = {"sub": tiny_src / "out", "same": tiny_src, "parent": tiny_src.parent}[where]
    res = cli("convert", tiny_src, out, "--recipe", "bf16")
    assert_refused(res, tiny_src, tiny_src / "never", before, "SOURCE")
    assert not (tiny_src / "out").exists()
    assert {p.name for p in tiny_src.parent.iterdir()} == {"src"}


def test_output_inside_source_via_dot_dot(cli, tiny_src: Path) -> None:
    before = tree_hashes(tiny_src)
    out = tiny_src / "a" / ".." / "b"
    res = cli("convert", tiny_src, out, "--recipe", "bf16")
    assert_refused(res, tiny_src, tiny_src / "never", before, "inside SOURCE")
    assert not (tiny_src / "b").exists()


def test_unknown_recipe(cli, tiny_src: Path, tmp_path: Path) -> None:
    before = tree_hashes(tiny_src)
    res = cli("convert", tiny_src, tmp_path / "out", "--recipe", "fp9")
    assert_refused(res, tiny_src, tmp_path / "out", before, "fp9", "bf16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "size", ["abc", "5XB", "MB", "", "inf", "nan", "1e400", "0", "-1MB", "0.5"]
)
def test_bad_max_shard_size(cli, tiny_src: Path, tmp_path: Path, size: str) -> None:
    before = tree_hashes(tiny_src)
    res = cli("convert", tiny_src, tmp_path / "out", "--recipe", "bf16", f"--max-shard-size={size}")
    assert_refused(res, tiny_src, tmp_path / "out", before, repr(size))
    assert not (tmp_path / "out").exists()


def test_calib_data_on_a_non_calibrating_recipe(cli, tiny_src: Path, tmp_path: Path) -> None:
    before = tree_hashes(tiny_src)
    text = tmp_path / "calib.txt"
    text.write_text("hello")
    res = cli("convert", tiny_src, tmp_path / "out", "--recipe", "bf16", "--calib-data", text)
    assert_refused(res, tiny_src, tmp_path / "out", before, "--calib-data")


def test_source_not_a_directory(cli, tmp_path: Path) -> None:
    res = cli("convert", tmp_path / "nope", tmp_path / "out", "--recipe", "bf16")
    assert res.exit_code == 2 and res.stderr.startswith("error: ")
    assert "nope" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()
