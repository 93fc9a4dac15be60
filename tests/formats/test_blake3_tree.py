"""BLAKE3 from pieces hashed in any order (formats/blake3_tree.py, _blake3_native.cpp): the
standard digest (the ``blake3`` package's) on every instruction path of this CPU, for inputs
around every chunk and power-of-two boundary, split anywhere, with gaps hashed at the end."""

from __future__ import annotations

import ctypes
import itertools
import os
import random

import numpy as np
import pytest
from blake3 import blake3

from hetquant.formats import blake3_tree as bt

pytestmark = pytest.mark.skipif(not bt.available(), reason="no C++ compiler: the package path runs")
PATHS = [n for n in bt.LANES if n <= bt.lanes()]
SIZES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 2049, 3071, 4096, 4097, 16 * 1024 + 1,
         17 * 1024 - 1, 31 * 1024, 32 * 1024, 33 * 1024 + 5, 100_003, (1 << 20) + 1]  # fmt: skip


def _data(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _cuts(size: int, rng: random.Random, n: int) -> list[tuple[int, int]]:
    points = sorted(rng.sample(range(1, size), min(size - 1, n))) if size > 1 else []
    edges = [0, *points, size]
    pieces = list(itertools.pairwise(edges))
    rng.shuffle(pieces)
    return pieces


def test_the_paths_of_this_cpu_are_known() -> None:
    assert bt.lanes() in bt.LANES and PATHS[0] == 4


@pytest.mark.parametrize("lanes", PATHS)
@pytest.mark.parametrize("size", SIZES)
def test_pieces_in_any_order_give_the_package_digest(size: int, lanes: int) -> None:
    data = _data(size, size)
    want = blake3(data.tobytes()).hexdigest()
    rng = random.Random(size * 31 + lanes)
    for pieces in ([(0, size)], _cuts(size, rng, 3), _cuts(size, rng, 40), []):
        tree = bt.TreeDigest(size, data=data, lanes=lanes)
        for start, end in pieces:
            tree.add(start, end)
        assert tree.hexdigest() == want, (size, lanes, pieces)


@pytest.mark.parametrize("lanes", [1, 3, 5, 6, 7, 9, 12, 15, 17, 64, -1])
def test_any_lane_count_asked_for_takes_a_path_that_exists(lanes: int) -> None:
    """``lanes`` is "at most that many": a width between the paths (16, 8, 4) takes the narrower
    one, under 4 the 4-lane one, past this CPU's best its best. A width between them once ran
    the 4-lane code while stepping by the width asked for (chunks left unhashed, digests wrong
    and different from run to run)."""
    size = 100_003
    data = _data(size, 21)
    tree = bt.TreeDigest(size, data=data, lanes=lanes)
    for start, end in _cuts(size, random.Random(lanes), 5):
        tree.add(start, end)
    assert tree.hexdigest() == blake3(data.tobytes()).hexdigest()


def test_a_large_input_on_a_thread_pool_in_piece_order() -> None:
    from concurrent.futures import ThreadPoolExecutor

    size = (40 << 20) + 12345  # more than MAX_SUBTREE chunks: capped nodes
    data = _data(size, 7)
    tree = bt.TreeDigest(size, data=data)
    pieces = _cuts(size, random.Random(1), 200)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: tree.add(*p), pieces))
    assert tree.hashed >= size - 201 * bt.CHUNK  # only the chunks that straddle two pieces left
    want = blake3(data.tobytes()).hexdigest()
    assert tree.hexdigest() == want
    assert bt.TreeDigest(size, data=data).hexdigest() == want  # all gaps: capped reads


def test_a_file_is_read_a_buffer_at_a_time_and_a_short_one_is_an_os_error(tmp_path) -> None:
    size = 3 * bt.MAX_SUBTREE * bt.CHUNK + 999
    data = _data(size, 5)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        tree = bt.TreeDigest(size, fd=fd, path=str(path))
        for start, end in _cuts(size, random.Random(2), 9):
            tree.add(start, end)
        assert tree.hexdigest() == blake3(data.tobytes()).hexdigest()
        with pytest.raises(OSError, match="end of file"):
            bt.TreeDigest(size + bt.CHUNK, fd=fd, path=str(path)).hexdigest()
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [1025, 5000, 1 << 20, (1 << 20) + 1, 9 << 20])
def test_nodes_are_aligned_powers_of_two_inside_the_range_and_never_the_root(size: int) -> None:
    n = -(-size // bt.CHUNK)
    data = _data(size, 11)
    tree = bt.TreeDigest(size, data=data)
    rng = random.Random(size)
    for _ in range(100):
        start = rng.randrange(size)
        end = rng.randrange(start + 1, size + 1)
        first, k, _ = tree.nodes(start, end)
        for a, b in zip(first.tolist(), k.tolist(), strict=True):
            assert b & (b - 1) == 0 and a % b == 0 and b < n and b <= bt.MAX_SUBTREE
            assert a * bt.CHUNK >= start and min((a + b) * bt.CHUNK, size) <= end
        assert list(first) == sorted(first) and all(np.diff(first) == k[:-1])  # contiguous
        whole = (end if end < size else n * bt.CHUNK) // bt.CHUNK - -(-start // bt.CHUNK)
        assert int(k.sum()) == max(0, whole)  # every whole chunk of the range, once


def _each_node_alone(data: np.ndarray, at: int, size: int, nodes: tuple) -> None:
    """Every node's chaining value is that of its bytes (``data`` holds input bytes from
    ``at`` on) hashed alone by ``hq_b3_subtree``."""
    lib = bt._LIBRARY.get().lib
    for a, k, cv in zip(*nodes, strict=True):
        nbytes = min((a + k) * bt.CHUNK, size) - a * bt.CHUNK
        out = ctypes.create_string_buffer(32)
        ptr = data.ctypes.data + int(a) * bt.CHUNK - at
        assert lib.hq_b3_subtree(ptr, nbytes, int(a), out, 4) == 0
        assert bytes(cv) == out.raw, (a, k)


@pytest.mark.parametrize("lanes", PATHS)
def test_a_ranges_nodes_hashed_together_equal_each_node_hashed_alone(lanes: int, tmp_path) -> None:
    """``hq_b3_range`` compresses the chunks of all nodes in a window of ``MAX_SUBTREE`` chunks
    together (the short edge nodes of an unaligned range included, the input's short last chunk
    too); each node's chaining value must be that node's ``hq_b3_subtree`` — from memory and from
    a file, for ranges spanning several windows."""
    size = (2 * bt.MAX_SUBTREE + 37) * bt.CHUNK + 517
    data = _data(size, 13)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    rng = random.Random(lanes)
    ranges = [(bt.CHUNK + 1, size), (3 * bt.CHUNK, size - 600)]
    ranges += [(rng.randrange(size // 2), rng.randrange(size // 2, size + 1)) for _ in range(6)]
    try:
        for start, end in ranges:
            from_mem = bt.range_nodes(size, data, 0, start, end, lanes)
            from_file = bt._range(fd, None, 0, size, start, end, lanes)[1]
            assert len(from_mem[0]) > 3  # edge nodes and whole windows
            for got in (from_mem, from_file):
                _each_node_alone(data, 0, size, got)
    finally:
        os.close(fd)


def test_a_buffer_whose_address_is_its_offset_is_read_from_memory() -> None:
    """``hq_b3_range`` reads the buffer through the input's byte 0 as an address: the buffer's
    address minus its offset, which is 0 where the two are equal — possible where a non-PIE
    Python's heap (system Pythons: ~10 MB-1 GB up) overlaps a 5 GB shard's offsets. That 0 was
    taken for "no buffer, read the file" (fd -1), and the worker's write failed with "blake3
    node list overflow" (seen once on the 16-core host, pwrite onto tmpfs)."""
    data = _data(3 * bt.CHUNK * 1024 + 77, 17)
    for at in (data.ctypes.data, data.ctypes.data - 5, data.ctypes.data + 4096):
        size = at + data.size + 9 * bt.CHUNK
        nodes = bt.range_nodes(size, data, at, at, at + data.size)
        assert int(nodes[1].sum()) >= data.size // bt.CHUNK - 1
        _each_node_alone(data, at, size, nodes)


def test_data_or_a_file_not_both() -> None:
    with pytest.raises(ValueError, match="data or fd"):
        bt.TreeDigest(10)


@pytest.mark.parametrize("lanes", PATHS)
def test_high_chunk_counters_agree_between_the_vector_and_scalar_paths(lanes: int) -> None:
    """Counters past 2**32 (a file over 4 TiB): the vector lanes' high word equals the scalar
    code's (a 16-chunk subtree against its chunks hashed one by one and merged)."""
    lib = bt._LIBRARY.get().lib
    data = _data(16 * bt.CHUNK, 3)
    counter = (1 << 32) + 5 * 16 - 16  # crosses no 2**32 boundary inside, but hi word != 0

    def subtree(offset: int, nbytes: int, at: int, lanes: int) -> bytes:
        out = ctypes.create_string_buffer(32)
        assert lib.hq_b3_subtree(data.ctypes.data + offset, nbytes, at, out, lanes) == 0
        return out.raw

    level = [subtree(i * bt.CHUNK, bt.CHUNK, counter + i, 4) for i in range(16)]  # scalar
    while len(level) > 1:
        merged = []
        for a, b in zip(level[::2], level[1::2], strict=True):
            out = ctypes.create_string_buffer(32)
            lib.hq_b3_parent(a, b, 0, out)
            merged.append(out.raw)
        level = merged
    assert subtree(0, 16 * bt.CHUNK, counter, lanes) == level[0]


def test_a_run_that_is_not_a_subtree_is_refused() -> None:
    lib = bt._LIBRARY.get().lib
    data = _data(3 * bt.CHUNK)
    out = ctypes.create_string_buffer(32)
    assert lib.hq_b3_subtree(data.ctypes.data, 3 * bt.CHUNK, 0, out, 0) == -1  # 3 chunks
    assert lib.hq_b3_subtree(data.ctypes.data, 0, 0, out, 0) == -1
    assert lib.hq_b3_single(data.ctypes.data, bt.CHUNK + 1, out) == -1


@pytest.mark.parametrize(
    "size", [2 * 1024, 8 * 1024, 8 * 1024 + 1, 100_003, (1 << 20) + 1, 1 << 21, 10 * (1 << 20) + 7]
)
def test_compacted_nodes_give_the_same_digest_and_never_the_root(size: int) -> None:
    """Nodes of many small ranges (1-5 chunks, a few left out) merged by ``compact_nodes``:
    the package's digest, no more nodes than before and as few as the chunks allow (the
    nodes of one range over the same bytes), aligned powers of two, never the root."""
    data = _data(size, 3)
    rng = random.Random(size)
    nodes, at, skipped = [], 0, 0
    while at < size:
        end = min(size, at + rng.randint(1, 5) * bt.CHUNK)
        if rng.random() < 0.1:
            skipped += 1  # left for the merge to hash from the data
        else:
            nodes.append(bt.range_nodes(size, data[at:end], at, at, end))
        at = end
    first, k, cv = (np.concatenate(p) for p in zip(*nodes, strict=True))
    f2, k2, c2 = bt.compact_nodes(size, first, k, cv)
    chunks = -(-size // bt.CHUNK)
    assert len(f2) <= len(first) and (f2 % k2 == 0).all() and (k2 & (k2 - 1) == 0).all()
    assert (k2 < chunks).all() and bt.covered_bytes(size, f2, k2) == bt.covered_bytes(
        size, first, k
    )
    tree = bt.TreeDigest(size, data=data)
    tree.add_nodes(f2, k2, c2)
    assert tree.hexdigest() == blake3(data.tobytes()).hexdigest()
    if not skipped:  # one covered run: as few as hashing it whole gives, or fewer
        whole = bt.TreeDigest(size, data=data).nodes(0, size)[0]
        assert len(f2) <= len(whole)
    flipped = c2.copy()
    flipped[-1, 0] ^= 1
    tree = bt.TreeDigest(size, data=data)
    tree.add_nodes(f2, k2, flipped)
    assert tree.hexdigest() != blake3(data.tobytes()).hexdigest()


def test_a_file_of_a_power_of_two_chunks_keeps_its_two_halves() -> None:
    """Every chunk of an 8-chunk input known: merged up to its two halves, not to the root."""
    size = 8 * bt.CHUNK
    data = _data(size, 4)
    nodes = [bt.range_nodes(size, data[i * 1024 : (i + 1) * 1024], i * 1024, i * 1024, (i + 1) * 1024) for i in range(8)]  # fmt: skip
    f2, k2, c2 = bt.compact_nodes(size, *(np.concatenate(p) for p in zip(*nodes, strict=True)))
    assert f2.tolist() == [0, 4] and k2.tolist() == [4, 4]
    tree = bt.TreeDigest(size, data=data)
    tree.add_nodes(f2, k2, c2)
    assert tree.hexdigest() == blake3(data.tobytes()).hexdigest()


def test_merged_nodes_larger_than_a_hashed_one_are_used() -> None:
    """16 MiB + 5 bytes stored in 1 MiB slices (one run): merged into a node of 16,384 chunks
    (4x ``MAX_SUBTREE``, what one read hashes) and the last chunk's; the digest is the package's."""
    size = (16 << 20) + 5
    data = _data(size, 5)
    step = 1 << 20
    nodes = [bt.range_nodes(size, data[a : a + step], a, a, min(size, a + step)) for a in range(0, size, step)]  # fmt: skip
    f2, k2, c2 = bt.compact_nodes(size, *(np.concatenate(p) for p in zip(*nodes, strict=True)))
    assert f2.tolist() == [0, 16384] and k2.tolist() == [16384, 1] and 16384 > bt.MAX_SUBTREE
    tree = bt.TreeDigest(size, data=data)
    tree.add_nodes(f2, k2, c2)
    assert tree.hexdigest() == blake3(data.tobytes()).hexdigest()
