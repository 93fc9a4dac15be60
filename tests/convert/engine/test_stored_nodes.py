"""The tree nodes a writer hashes as it stores (convert/engine/stored_nodes.py): whatever the
sizes and order of the writes, the nodes with the file's other bytes give its one-shot BLAKE3;
runs of contiguous writes leave only the chunk they start in to the parent."""

from __future__ import annotations

import itertools

import blake3
import numpy as np
import pytest

from hetquant.convert.engine.stored_nodes import StoredNodes
from hetquant.formats.blake3_tree import CHUNK, TreeDigest, available, range_nodes

pytestmark = pytest.mark.skipif(not available(), reason="needs the BLAKE3 subtree kernel")


def _digest(data: np.ndarray, nodes) -> tuple[str, int]:
    tree = TreeDigest(data.size, data=data)
    for _, (first, k, cv) in nodes:
        tree.add_nodes(first, k, cv)
    return tree.hexdigest(), tree.hashed


@pytest.mark.parametrize("size", [5 * CHUNK + 17, 64 * CHUNK, 300_001])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_writes_give_the_one_shot_digest(size: int, seed: int) -> None:
    """Two files written in interleaved runs of random sizes (1 byte to whole chunks), some
    out of order; a take between two writes ends their run."""
    rng = np.random.default_rng(seed)
    files = {"a": rng.integers(0, 256, size, dtype=np.uint8), "b": rng.integers(0, 256, size // 3 + 5, dtype=np.uint8)}  # fmt: skip
    s = StoredNodes({n: d.size for n, d in files.items()})
    cuts = {n: sorted({0, d.size, *rng.integers(1, d.size, 25).tolist()}) for n, d in files.items()}
    writes = [(n, a, b) for n, c in cuts.items() for a, b in itertools.pairwise(c)]
    order = list(range(len(writes)))
    for i in rng.choice(len(order), 6, replace=False):  # a few out of place
        j = int(rng.integers(0, len(order)))
        order[i], order[j] = order[j], order[i]
    nodes, stored = [], 0
    for i in order:
        name, a, b = writes[i]
        s.stored(name, a, files[name][a:b])
        if rng.random() < 0.1:
            got, n = s.take()
            nodes += got
            stored += n
    got, n = s.take()
    nodes += got
    assert stored + n == sum(d.size for d in files.values())
    assert nodes  # the writes' runs do carry nodes
    for name, data in files.items():
        digest, covered = _digest(data, [x for x in nodes if x[0] == name])
        assert digest == blake3.blake3(data.tobytes()).hexdigest()
        assert data.size < 64 * CHUNK or covered >= data.size // 2  # the nodes carry most


def test_a_run_leaves_only_the_chunk_it_starts_in() -> None:
    """Bytes 100 .. end written front to back in 1-byte to 3 kB writes: the nodes cover all of
    them from the first chunk boundary on, the file's last partial chunk included."""
    size = 20 * CHUNK + 333
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    s = StoredNodes({"f": size})
    at = 100
    for step in [1, 1, 900, 23, 3000, 1024, 5, 7000, 2048, 10**6]:
        s.stored("f", at, data[at : at + step])
        at = min(size, at + step)
    nodes, n = s.take()
    assert n == size - 100
    digest, covered = _digest(data, nodes)
    assert digest == blake3.blake3(data.tobytes()).hexdigest()
    assert covered == size - CHUNK


def test_range_nodes_refuses_a_range_outside_its_buffer() -> None:
    buf = np.zeros(4 * CHUNK, np.uint8)
    with pytest.raises(ValueError, match="not inside"):
        range_nodes(10 * CHUNK, buf, CHUNK, 0, 2 * CHUNK)
    with pytest.raises(ValueError, match="not inside"):
        range_nodes(10 * CHUNK, buf, CHUNK, CHUNK, 6 * CHUNK)
    first, k, _ = range_nodes(10 * CHUNK, buf, CHUNK, CHUNK, 5 * CHUNK)
    assert first.tolist() == [1, 2, 4] and k.tolist() == [1, 2, 1]  # aligned, largest first


def test_writes_alternating_between_two_tensors_of_a_file_each_continue() -> None:
    """Rows of two tensors of one file written in turns (a weight's codes and its scales):
    each tensor's run continues past the other's writes."""
    size = 40 * CHUNK
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    s = StoredNodes({"f": size})
    a, b = 10, 20 * CHUNK + 10  # the two tensors' starts, mid-chunk
    for step in range(10):
        s.stored("f", a + step * 1500, data[a + step * 1500 : a + (step + 1) * 1500])
        s.stored("f", b + step * 700, data[b + step * 700 : b + (step + 1) * 700])
    nodes, _ = s.take()
    digest, covered = _digest(data, nodes)
    assert digest == blake3.blake3(data.tobytes()).hexdigest()
    # all but each run's first partial chunk and its unfinished last one
    assert covered == (15000 + 10) // CHUNK * CHUNK - CHUNK + (b + 7000) // CHUNK * CHUNK - (b // CHUNK + 1) * CHUNK  # fmt: skip
