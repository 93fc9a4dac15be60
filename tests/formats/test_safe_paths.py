"""``formats/safe_paths.py``: names kept inside their directory (the Hub cache's blobs excepted),
only regular files opened — the one rule every reader applies (issue 25 §1, §2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import hf_cache_snapshot, no_hang

from hetquant.formats import HetquantError
from hetquant.formats.safe_paths import inside, is_inside, open_binary, read_regular
from hetquant.formats.safetensors_io import MappedFile, read_header

SECRET = b"TOPSECRET-do-not-print\n"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "secret.txt").write_bytes(SECRET)
    art = tmp_path / "art"
    (art / "sub").mkdir(parents=True)
    (art / "a.safetensors").write_bytes(b"x")
    (art / "sub" / "b.safetensors").write_bytes(b"y")
    return art


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("../secret.txt", "points outside the artifact"),
        ("sub/../../secret.txt", "points outside the artifact"),
        ("ABS", "points outside the artifact"),
        ("", "is not a file name"),
        (7, "is not a file name"),
        (None, "is not a file name"),
        ("a\0b", "is not a file name"),
    ],
)
def test_names_that_leave_the_directory_are_refused(root: Path, name: object, words: str) -> None:
    name = str(root.parent / "secret.txt") if name == "ABS" else name
    with pytest.raises(HetquantError, match=words) as e:
        inside(root, name, root / "hetquant.json", "shard")
    assert str(e.value).startswith(f"{root / 'hetquant.json'}: shard ")
    assert "TOPSECRET" not in str(e.value)


def test_a_link_out_of_the_directory_is_refused(root: Path) -> None:
    os.symlink(root.parent / "secret.txt", root / "model.safetensors")
    os.symlink("../../secret.txt", root / "sub" / "c.safetensors")
    os.symlink(root.parent, root / "up")
    for name in ("model.safetensors", "sub/c.safetensors", "up/secret.txt"):
        with pytest.raises(
            HetquantError, match=r"is a link to .*secret\.txt, outside the artifact"
        ):
            inside(root, name, "index")
        assert not is_inside(root, root / name)


def test_names_inside_are_the_joined_path(root: Path) -> None:
    os.symlink("a.safetensors", root / "alias.safetensors")  # a link that stays inside
    for name in ("a.safetensors", "sub/b.safetensors", "./a.safetensors", "alias.safetensors"):
        assert inside(root, name, "index") == root / name
    assert inside(root, "missing.safetensors", "index") == root / "missing.safetensors"


def test_a_hub_cache_snapshot_may_link_into_its_blobs(root: Path, tmp_path: Path) -> None:
    snap = hf_cache_snapshot(root, tmp_path / "cache")
    assert (snap / "sub" / "b.safetensors").is_symlink()
    for name in ("a.safetensors", "sub/b.safetensors"):
        assert inside(snap, name, "index") == snap / name
        assert read_regular(snap / name) == read_regular(root / name)
    # ... and nowhere else: not another repo's blobs, not a file beside the cache
    other = hf_cache_snapshot(root, tmp_path / "cache2", "org/other")
    os.symlink(other.parents[1] / "blobs" / os.readlink(other / "a.safetensors").split("/")[-1],
               snap / "foreign.safetensors")  # fmt: skip
    os.symlink(tmp_path / "secret.txt", snap / "secret.safetensors")
    for name in ("foreign.safetensors", "secret.safetensors"):
        with pytest.raises(HetquantError, match="outside the artifact"):
            inside(snap, name, "index")


def _special(kind: str, path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a character device: link to /dev/null (the link stays a link to a device)
        os.symlink("/dev/null", path)
    return path


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("fifo", r"is a FIFO \(named pipe\)"),
        ("device", "is a character device"),
    ],
)
def test_only_regular_files_are_opened(tmp_path: Path, kind: str, words: str) -> None:
    path = _special(kind, tmp_path / "model.safetensors")
    for read in (read_regular, read_header, MappedFile):
        with no_hang(), pytest.raises(HetquantError, match=f"model.safetensors: {words}, not a"):
            read(path)


def test_a_directory_is_the_os_error_every_command_prints(tmp_path: Path) -> None:
    path = _special("directory", tmp_path / "model.safetensors")
    for read in (read_regular, read_header, MappedFile):
        with pytest.raises(IsADirectoryError) as e:
            read(path)
        assert e.value.filename == str(path)


def test_open_binary_reads_a_regular_file_blocking(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(SECRET)
    with open_binary(tmp_path / "f") as f:
        assert os.get_blocking(f.fileno()) and f.read() == SECRET
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing")
