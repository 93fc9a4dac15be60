"""Untrusted artifacts, the edge values a fuzzing campaign found (session 13: 710 random
mutations of tiny artifacts through inspect, verify, run and the API): each ended in a traceback
or read without bound before; each is now one ``error:`` line (exit 2) or a ``HetquantError``."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from support import MANIFEST, error_line, read_json, run_cli, st_header, write_json

from hetquant.formats import HetquantError
from hetquant.formats.json_io import MAX_JSON_BYTES
from hetquant.formats.safetensors_io import MAX_DIMS, read_header
from hetquant.runtime import open_artifact

INDEX = "model.safetensors.index.json"


@pytest.fixture
def art(tiny_hybrid: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_hybrid, tmp_path / "art"))


def _refused(*args: object, needle: str) -> None:
    res = run_cli(*args)
    assert res.exit_code == 2 and res.exception is None, res.stderr
    assert needle in error_line(res.stderr), res.stderr


def test_a_listed_file_that_links_to_itself(art: Path) -> None:
    (art / "generation_config.json").unlink()  # a file the artifact carries, found by listing
    (art / "generation_config.json").symlink_to("generation_config.json")
    _refused("inspect", art, needle="generation_config.json: a symbolic link loop")
    res = run_cli("verify", art)  # a failed check or one error line, never a traceback
    assert res.exit_code in (1, 2) and res.exception is None and "Traceback" not in res.stderr


@pytest.mark.parametrize("file", ["config.json", MANIFEST, INDEX])
def test_a_number_longer_than_python_reads(art: Path, file: str) -> None:
    text = (art / file).read_text()
    (art / file).write_text(text.replace("{", '{"n": ' + "9" * 5000 + ", ", 1))
    _refused("run", art, "--tokens", "1,2,3", needle="a number too long to read")


def _shard_with_shape(path: Path, shape: list[int]) -> None:
    header = json.dumps({"t": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize(
    "shape", [[10**3000, 10**3000, 0], [0] + [2**62] * 300_000, [1] * (MAX_DIMS + 1), [2**63, 0]]
)
def test_a_header_shape_past_any_weight_is_malformed(tmp_path: Path, shape: list[int]) -> None:
    """Digits enough to break formatting the byte count, dims enough that their product takes
    minutes: refused before either is computed."""
    _shard_with_shape(tmp_path / "x.safetensors", shape)
    with pytest.raises(HetquantError, match="malformed header entry for tensor 't'"):
        read_header(tmp_path / "x.safetensors")


def test_an_index_value_that_is_no_file_name(art: Path) -> None:
    doc = read_json(art / INDEX)
    doc["weight_map"][next(iter(doc["weight_map"]))] = {"a": 1}
    write_json(art / INDEX, doc)
    _refused("run", art, "--tokens", "1,2,3", needle="a weight_map value is not a file name")


@pytest.mark.parametrize("layer", ["one", "\u00b2"])  # a word; a digit int() does not read
def test_a_cpu_experts_file_not_named_by_its_layer(art: Path, layer: str) -> None:
    doc = read_json(art / MANIFEST)
    files = doc["parts"]["cpu_experts"]["files"]
    old = files[0]
    new = f"{old.rpartition('_')[0]}_{layer}.safetensors"
    (art / old).rename(art / new)
    files[0] = new
    doc["files"] = {(new if k == old else k): v for k, v in doc["files"].items()}
    write_json(art / MANIFEST, doc)
    _refused("run", art, "--tokens", "1,2,3", needle="is not named layer_<number>.safetensors")


def test_a_manifest_past_the_json_limit_is_not_read(art: Path) -> None:
    os.truncate(art / MANIFEST, MAX_JSON_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(HetquantError, match="more than the 100,000,000 a JSON file here may have"):
        open_artifact(art)
    _refused("run", art, "--tokens", "1,2,3", needle="a JSON file here may have")


def test_a_tokenizer_past_the_json_limit_is_not_read(art: Path) -> None:
    os.truncate(art / "tokenizer.json", MAX_JSON_BYTES + 1)  # sparse: the library read it whole
    _refused("run", art, "--prompt", "Hello", needle="tokenizer.json: 100,000,001 bytes")


def test_a_zero_byte_stacked_tensor_does_not_vouch_for_a_million_experts(art: Path) -> None:
    """``verify`` bounds what config.json claims by what the files can hold; a stacked tensor of
    2^40 experts holding no bytes counted as 2^42 tensors, and a config claiming 10^6 experts a
    layer was then expanded (minutes, GBs)."""
    shard = art / "model-00001-of-00001.safetensors"
    start, header = st_header(shard)
    data = shard.read_bytes()[start:]
    header["empty"] = {"dtype": "U8", "shape": [2**40, 0, 0], "data_offsets": [len(data)] * 2}
    raw = json.dumps(header).encode()
    shard.unlink()  # a hard link of the session's artifact: replaced, not written
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    cfg = read_json(art / "config.json")
    write_json(art / "config.json", {**cfg, "n_routed_experts": 10**6})
    res = run_cli("verify", art)  # a failed check, from the bound
    assert res.exit_code == 1 and "more than the artifact's files hold" in res.stdout, res.stdout
