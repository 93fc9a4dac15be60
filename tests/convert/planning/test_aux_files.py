"""Every small non-weight file of a source travels; weights, index, config, hidden files, large
files and links out of the source do not."""

from __future__ import annotations

import os
from pathlib import Path

from hetquant.convert.planning.aux_files import WEIGHT_SUFFIXES, aux_files

K2_FILES = ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json", "configuration_deepseek.py",
            "modeling_deepseek.py", "LICENSE", "README.md")  # fmt: skip
QWEN_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "special_tokens_map.json")


def _touch(path: Path, size: int = 10) -> Path:
    path.write_bytes(b"x" * size)
    return path


def test_every_small_non_weight_file_travels(tmp_path: Path) -> None:
    for name in K2_FILES + QWEN_FILES:
        _touch(tmp_path / name)
    for suffix in WEIGHT_SUFFIXES:
        _touch(tmp_path / f"model-00001-of-00002{suffix}")
    for name in ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                 ".gitattributes", ".hidden.jinja"):  # fmt: skip
        _touch(tmp_path / name)
    (tmp_path / "original").mkdir()
    _touch(tmp_path / "original" / "tokenizer.model")
    got = aux_files(tmp_path)
    assert got.names == sorted(K2_FILES + QWEN_FILES)
    assert got.skipped == {}


def test_reserved_names_and_size_bound(tmp_path: Path) -> None:
    _touch(tmp_path / "quant_model_description.json")
    _touch(tmp_path / "hetquant.json")
    _touch(tmp_path / "tokenizer.json", 101)
    _touch(tmp_path / "tiktoken.model", 100)
    got = aux_files(tmp_path, reserved={"quant_model_description.json", "hetquant.json"},
                    max_bytes=100)  # fmt: skip
    assert got.names == ["tiktoken.model"]
    assert list(got.skipped) == ["tokenizer.json"] and "101 bytes" in got.skipped["tokenizer.json"]


def test_links_inside_travel_links_outside_do_not(tmp_path: Path) -> None:
    src, outside = tmp_path / "src", tmp_path / "secret"
    src.mkdir()
    _touch(outside)
    _touch(src / "real.jinja")
    os.symlink(src / "real.jinja", src / "chat_template.jinja")
    os.symlink(outside, src / "tokenizer.json")
    os.symlink(src / "missing", src / "broken.json")
    got = aux_files(src)
    assert got.names == ["chat_template.jinja", "real.jinja"]
    assert (
        list(got.skipped) == ["tokenizer.json"]
        and "outside the source" in got.skipped["tokenizer.json"]
    )


def test_hugging_face_cache_snapshot_links_into_blobs(tmp_path: Path) -> None:
    """The cache keeps files in ``blobs/`` and links them from ``snapshots/<commit>/``."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / ("a" * 40)
    blobs.mkdir()
    snap.mkdir(parents=True)
    _touch(blobs / "0123abcd")
    os.symlink(Path("../..") / "blobs" / "0123abcd", snap / "tiktoken.model")
    assert aux_files(snap).names == ["tiktoken.model"]
