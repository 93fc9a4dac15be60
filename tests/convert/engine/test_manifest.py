"""File digests of the manifest (convert/engine/manifest.py): the BLAKE3 (schema 3) or sha256 (schemas
1-2) of every file, several files at once, equal to a one-shot hash of the whole file whatever the
block and thread count."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import pytest

from hetquant.convert.engine.manifest import HASH_READ, digest_files, file_digest, hash_threads
from hetquant.formats.file_digests import DIGESTS, FILE_DIGEST

ONE_SHOT = {"sha256": lambda b: hashlib.sha256(b).hexdigest(), "blake3": lambda b: blake3.blake3(b).hexdigest()}  # fmt: skip


def _files(tmp_path: Path, sizes: list[int]) -> dict[str, Path]:
    out = {}
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(os.urandom(size))
        out[path.name] = path
    return out


def _want(path: Path, alg: str = FILE_DIGEST) -> dict[str, object]:
    data = path.read_bytes()
    return {"size": len(data), alg: ONE_SHOT[alg](data)}


def test_the_registry_is_what_the_tests_check() -> None:
    assert set(DIGESTS) == set(ONE_SHOT) and FILE_DIGEST == "blake3"


@pytest.mark.parametrize("alg", sorted(DIGESTS))
@pytest.mark.parametrize("threads", [1, 3])
def test_file_digest_across_block_boundaries(tmp_path: Path, alg: str, threads: int) -> None:
    algorithm = DIGESTS[alg]
    blocks = {HASH_READ, algorithm.stream_read, algorithm.bulk_read}
    sizes = [0, 1, *(b + d for b in sorted(blocks) for d in (-1, 0, 1)), 3 * HASH_READ + 17]
    for path in _files(tmp_path, sizes).values():
        assert file_digest(path, algorithm, threads) == _want(path, alg)


@pytest.mark.parametrize("alg", sorted(DIGESTS))
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_digest_files_equals_one_by_one_in_the_given_order(tmp_path: Path, threads: int, alg: str) -> None:  # fmt: skip
    big = DIGESTS[alg].bulk_read + 5  # hashed on a pool of threads
    paths = _files(tmp_path, [5000, 3 * HASH_READ + 1, 0, 70_000, HASH_READ, big])
    reordered = {n: paths[n] for n in reversed(list(paths))}  # the smallest file first
    got = digest_files(reordered, threads, DIGESTS[alg])
    assert list(got) == list(reordered)
    assert got == {n: _want(p, alg) for n, p in reordered.items()}
    assert digest_files({}) == {}


def test_digest_files_raises_the_read_error(tmp_path: Path) -> None:
    paths = _files(tmp_path, [100, 200])
    paths["gone.bin"] = tmp_path / "gone.bin"
    with pytest.raises(FileNotFoundError, match=r"gone\.bin"):
        digest_files(paths, 2)


def test_hash_threads() -> None:
    assert [hash_threads(c) for c in (1, 2, 4, 8, 16, 64)] == [2, 2, 4, 8, 8, 8]
    assert 2 <= hash_threads() <= 8
