"""The ``hetquant`` commands: recipes, inspect, convert --dry-run, verify."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from support import (
    INDEX,
    MANIFEST,
    PARTIAL,
    TINY,
    as_older_schema,
    read_json,
    st_header,
    tiny_counts,
    tree_hashes,
)

GROUPS = ("embeddings", "norms", "attention", "dense_mlp", "router", "shared_experts",
          "routed_experts", "mtp")  # fmt: skip


def test_recipes_lists_bf16(cli) -> None:
    res = cli("recipes")
    assert res.exit_code == 0 and res.stderr == ""
    lines = res.stdout.splitlines()
    assert lines and all(len(line.split(maxsplit=1)) == 2 for line in lines)  # name + summary
    assert "bf16" in [line.split()[0] for line in lines]


def _group_rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.split()}


def test_inspect_source_prints_groups(tiny_ro: Path, cli) -> None:
    res = cli("inspect", tiny_ro)
    assert res.exit_code == 0, res.stderr
    rows = _group_rows(res.stdout)
    for g in GROUPS:
        assert g in rows, g
    assert rows["attention"][0] == "fp8_block"  # as stored: block FP8 ...
    assert rows["norms"][0] == "bf16"
    assert re.search(rf"^shards\s+{tiny_counts(tiny_ro)[1]}, ", res.stdout, re.M)
    assert rows["total"][0].replace(",", "").isdigit()


def test_inspect_counts_a_packed_int4_source_by_its_logical_shape(cli, tmp_path: Path) -> None:
    """Kimi K2 Thinking's experts are I32 words [n, k/8] + BF16 group scales: params n·k, bytes
    every stored part, 4.5 bits per weight (group 32), format named, totals = the shards' data."""
    from support import make_kimi_k2

    from hetquant.convert import SourceCheckpoint

    src = make_kimi_k2(tmp_path / "k2t", "thinking")
    rows = _group_rows(cli("inspect", src).stdout)
    ck = SourceCheckpoint.open(src)
    experts = [t for t in ck.tensors.values() if t.role.role.expert == "routed"]
    params = sum(t.role.shape[0] * t.role.shape[1] for t in experts)
    stored = sum(t.nbytes for t in experts)
    assert rows["routed_experts"] == ["ct_pack_quantized", f"{params:,}", f"{stored:,}", "4.500"]
    assert rows["total"][1] == f"{ck.total_bytes:,}"


def test_inspect_artifact_prints_groups(tiny_ro: Path, cli, tiny_artifact: Path) -> None:
    res = cli("inspect", tiny_artifact)
    assert res.exit_code == 0, res.stderr
    rows = _group_rows(res.stdout)
    for g in GROUPS:
        assert g in rows, g
    assert rows["attention"][0] == "bf16" and rows["attention"][-1] == "16.000"
    assert rows["recipe"] == ["bf16"]
    manifest = read_json(tiny_artifact / MANIFEST)
    size = (
        sum(f["size"] for f in manifest["files"].values())
        + (tiny_artifact / MANIFEST).stat().st_size
    )
    assert f"{len(manifest['files']) + 1} files, {size:,} bytes" in res.stdout
    # the parameter counts agree with the source's
    src_rows = _group_rows(cli("inspect", tiny_ro).stdout)
    for g in GROUPS:
        assert rows[g][1] == src_rows[g][1], g


def test_inspect_refuses_a_non_checkpoint(cli, tmp_path: Path) -> None:
    res = cli("inspect", tmp_path)
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------------------------
# --dry-run


@pytest.mark.parametrize("size", ["1MB", "5GB"])
def test_dry_run_prints_the_plan_creates_nothing_and_sizes_are_real(
    tiny_ro: Path, cli, tiny_artifact: Path, tiny_artifact_1mb: Path, tmp_path: Path, size: str
) -> None:
    out = tmp_path / "out"
    before = tree_hashes(tiny_ro)
    res = cli("convert", tiny_ro, out, "--recipe", "bf16", "--dry-run", "--max-shard-size", size)
    assert res.exit_code == 0, res.stderr
    assert not out.exists()
    assert tree_hashes(tiny_ro) == before
    planned = {
        m[1]: int(m[2].replace(",", ""))
        for m in re.finditer(r"^\s+(\S+\.safetensors)\s+([\d,]+) bytes", res.stdout, re.M)
    }
    real = tiny_artifact_1mb if size == "1MB" else tiny_artifact
    shards = {p.name: p.stat().st_size for p in real.glob("*.safetensors")}
    assert planned == shards
    total = re.search(r"total output: ([\d,]+) bytes", res.stdout)
    assert total and int(total[1].replace(",", "")) == sum(shards.values())
    jobs, shards = tiny_counts(tiny_ro)
    assert f"plan: {jobs} jobs from {shards} source shards" in res.stdout
    for g in GROUPS:
        assert re.search(rf"^{g}\s", res.stdout, re.M), g


# ----------------------------------------------------------------------------------------------
# verify


def test_verify_passes_on_a_fresh_artifact(cli, tiny_artifact: Path, tiny_artifact_1mb) -> None:
    for art in (tiny_artifact, tiny_artifact_1mb):
        res = cli("verify", art)
        assert res.exit_code == 0, res.stdout
        assert re.fullmatch(rf"{re.escape(str(art))}: OK \(\d+ files, [\d,]+ bytes\)\n", res.stdout)


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= mask
    path.write_bytes(bytes(data))


def _tensor_data_offset(path: Path) -> int:
    start, header = st_header(path)
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    return start + header[name]["data_offsets"][0] + 77


def _json_offsets(path: Path) -> list[int]:
    """Byte offsets worth flipping in a JSON file: structure, keys, numbers, strings."""
    text = path.read_bytes()
    picks = [0, len(text) // 3, len(text) // 2, len(text) - 2]
    picks += [m.start() for m in re.finditer(rb"\d", text)][:3]
    picks += [text.index(b'"') + 1]
    return sorted(set(picks))


def _cases(art: Path) -> list[tuple[str, int, int]]:
    shard = "model-00001-of-00001.safetensors"
    cases = [(shard, _tensor_data_offset(art / shard), 0x01), (shard, -1, 0x80)]
    cases += [(shard, 20, 0x01)]  # inside the header JSON
    for name in (INDEX, "config.json"):
        cases += [(name, off, 0x01) for off in _json_offsets(art / name)]
        cases += [(name, 0, 0xFF)]  # not even UTF-8 any more
    cases += [("tokenizer.json", 1000, 0x01)]
    return cases


def test_verify_fails_with_exit_1_on_any_single_flipped_byte(
    cli, tiny_artifact: Path, tmp_path: Path
) -> None:
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    for file, offset, mask in _cases(art):
        _flip(art / file, offset, mask)
        res = cli("verify", art)
        where = f"{file}@{offset}^{mask:#x}"
        assert res.exit_code == 1, (where, res.exit_code, res.stdout, res.stderr)
        assert re.search(rf"^FAIL {re.escape(file)}: ", res.stdout, re.M), (where, res.stdout)
        _flip(art / file, offset, mask)  # undo
        assert cli("verify", art).exit_code == 0, where


def test_verify_fails_on_a_deleted_file(cli, artifact_copy: Path) -> None:
    for name in ("config.json", "tokenizer.json", INDEX, "model-00001-of-00001.safetensors"):
        data = (artifact_copy / name).read_bytes()
        (artifact_copy / name).unlink()
        res = cli("verify", artifact_copy)
        assert res.exit_code == 1, (name, res.stdout, res.stderr)
        assert f"FAIL {name}: missing" in res.stdout
        (artifact_copy / name).write_bytes(data)
    assert cli("verify", artifact_copy).exit_code == 0


@pytest.mark.parametrize("extra", ["extra.txt", ".hidden", "sub/dir/x.safetensors"])
def test_verify_fails_on_an_extra_file(cli, artifact_copy: Path, extra: str) -> None:
    path = artifact_copy / extra
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    res = cli("verify", artifact_copy)
    assert res.exit_code == 1
    assert f"FAIL {extra}: not listed in the manifest" in res.stdout


def test_verify_fails_when_the_manifest_is_not_complete(cli, artifact_copy: Path) -> None:
    m = read_json(artifact_copy / MANIFEST)
    m["complete"] = False
    (artifact_copy / MANIFEST).write_text(json.dumps(m))
    res = cli("verify", artifact_copy)
    assert res.exit_code == 1 and "not marked complete" in res.stdout


def test_verify_checks_recorded_module_formats(cli, artifact_copy: Path) -> None:
    m = read_json(artifact_copy / MANIFEST)
    prefix = next(iter(m["module_formats"]))
    m["module_formats"][prefix]["format"] = "w8a8_dynamic"
    (artifact_copy / MANIFEST).write_text(json.dumps(m))
    res = cli("verify", artifact_copy)
    assert res.exit_code == 1 and "module_formats differ from the plan" in res.stdout


def test_verify_accepts_a_schema_1_manifest(cli, artifact_copy: Path) -> None:
    m = as_older_schema(read_json(artifact_copy / MANIFEST), artifact_copy, 1)
    (artifact_copy / MANIFEST).write_text(json.dumps(m))
    assert cli("verify", artifact_copy).exit_code == 0


def test_verify_a_directory_without_manifest_is_bad_input(
    tiny_ro: Path, cli, tmp_path: Path
) -> None:
    for target in (tmp_path, tiny_ro):
        res = cli("verify", target)
        assert res.exit_code == 2
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and MANIFEST in lines[0]
        assert "Traceback" not in res.stderr


def test_verify_a_corrupt_manifest_is_a_failed_check(cli, artifact_copy: Path) -> None:
    (artifact_copy / MANIFEST).write_text("{not json")
    res = cli("verify", artifact_copy)
    assert res.exit_code == 1 and f"FAIL {artifact_copy / MANIFEST}: invalid JSON" in res.stdout


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_missing_path_is_one_error_line(cli, tmp_path: Path, command: str) -> None:
    res = cli(command, tmp_path / "nope")
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: {tmp_path / 'nope'}: no such file or directory"]


def test_scratch_left_after_the_manifest_is_ignored_and_cleaned(
    cli, tiny_ro: Path, artifact_copy: Path
) -> None:
    scratch = artifact_copy / PARTIAL
    scratch.mkdir()
    (scratch / "journal").write_text("plan x\n")  # a kill between manifest and cleanup
    assert cli("verify", artifact_copy).exit_code == 0
    # another source directory: refused; the scratch may be an interrupted --overwrite: kept
    res = cli("convert", TINY, artifact_copy, "--recipe", "bf16")
    assert res.exit_code == 2 and "already holds an artifact" in res.stderr
    assert (scratch / "journal").exists()
    # the command that made the artifact: already complete, and the scratch is cleaned
    res = cli("convert", tiny_ro, artifact_copy, "--recipe", "bf16")
    assert res.exit_code == 0 and "already complete" in res.stdout, res.stderr
    assert not scratch.exists()
