"""``verify`` hashes with the algorithm the manifest names (issue 30): BLAKE3 since schema 3, and
an artifact an older hetquant wrote (schema 2, sha256) still verifies, fails on a changed byte
and loads. An unknown algorithm in every command: tests/convert/test_untrusted_artifacts.py."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from support import MANIFEST, blake3_hex, read_json, write_json

from hetquant.runtime import ParallelLayout, open_artifact


@pytest.fixture
def art(tiny_hybrid: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(tiny_hybrid, dst)
    return dst


def _as_schema_2(art: Path) -> dict:
    """Rewrite ``art``'s manifest as hetquant wrote it before schema 3: sha256, not named."""
    doc = read_json(art / MANIFEST)
    del doc["file_digest"]
    doc["schema_version"] = 2
    doc["files"] = {
        n: {"size": f["size"], "sha256": hashlib.sha256((art / n).read_bytes()).hexdigest()}
        for n, f in doc["files"].items()
    }
    write_json(art / MANIFEST, doc)
    return doc


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0x40  # in the tensor data, past the header
    path.unlink()  # a fresh inode: never write through to a file shared with a fixture
    path.write_bytes(bytes(data))


def test_a_new_artifact_records_blake3_and_verifies(cli, art: Path) -> None:
    doc = read_json(art / MANIFEST)
    assert (doc["schema_version"], doc["file_digest"]) == (3, "blake3")
    for name, want in doc["files"].items():
        assert want == {"size": os.path.getsize(art / name), "blake3": blake3_hex(art / name)}
    assert cli("verify", art).exit_code == 0
    name = next(n for n in doc["files"] if n.startswith("cpu_experts/"))
    _flip_a_byte(art / name)
    res = cli("verify", art)
    assert res.exit_code == 1 and f"FAIL {name}: blake3 differs from the manifest" in res.stdout


def test_a_schema_2_sha256_artifact_still_verifies_and_loads(cli, art: Path) -> None:
    doc = _as_schema_2(art)
    res = cli("verify", art)
    assert res.exit_code == 0, res.stdout + res.stderr
    opened = open_artifact(art)
    weights = opened.load(ParallelLayout())
    assert weights and opened.cpu_expert_pool(subpools=1).layers
    name = next(n for n in doc["files"] if n.endswith(".safetensors"))
    _flip_a_byte(art / name)
    res = cli("verify", art)
    assert res.exit_code == 1 and f"FAIL {name}: sha256 differs from the manifest" in res.stdout


def test_a_digest_of_another_algorithm_than_named_is_a_failed_check(cli, art: Path) -> None:
    """A schema-3 manifest whose entries hold sha256 under ``blake3`` (hand-edited): the digest
    does not match, and verify says which algorithm it hashed with."""
    doc = read_json(art / MANIFEST)
    name = "config.json"
    doc["files"][name]["blake3"] = hashlib.sha256((art / name).read_bytes()).hexdigest()
    write_json(art / MANIFEST, doc)
    res = cli("verify", art)
    assert res.exit_code == 1 and f"FAIL {name}: blake3 differs" in res.stdout
