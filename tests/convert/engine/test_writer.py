"""Pieces written through shared memory maps (convert/engine/writer.py) are the bytes ``pwrite`` gives;
a kernel that cannot populate falls back to ``pwrite``; a full file system is ENOSPC, not SIGBUS.
The maps are the default on tmpfs only (``fs/mounts.py``): the tests here that need them where
``tmp_path`` is a disk force them with ``HETQUANT_WRITE=mmap``."""

from __future__ import annotations

import errno
import itertools
import json
import re
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from support import tmpfs

from hetquant.convert.engine import writer
from hetquant.convert.engine.writer import PieceWriter
from hetquant.convert.planning.containers import OutTensor, SafetensorsFile
from hetquant.formats import TensorMeta
from hetquant.formats.blake3_tree import CHUNK, TreeDigest, available


def _file(n: int = 3 << 20) -> SafetensorsFile:
    """One container: a small tensor, then one of ``n`` bytes (pieces straddle pages)."""
    tensors = [OutTensor("a", TensorMeta("I32", (3,))), OutTensor("b", TensorMeta("U8", (n,)))]
    return SafetensorsFile("x.safetensors", "root", tensors)


def _write(f: SafetensorsFile, work: Path, mapped: bool) -> PieceWriter:
    f.create(work / f.name)
    w = PieceWriter([f], work, mapped=mapped)
    w.write("a", 4, torch.tensor([7, -1], dtype=torch.int32))
    n = f.tensors[1].meta.nbytes
    g = torch.Generator().manual_seed(0)
    for start in (n - 5000, 12345, 0):  # any order, unaligned
        end = min(n, start + 1_000_000)
        w.write("b", start, torch.randint(0, 256, (end - start,), generator=g, dtype=torch.uint8))  # fmt: skip
    return w


@pytest.fixture
def maps(monkeypatch) -> None:
    monkeypatch.setenv(writer.WRITE_ENV, "mmap")


def test_mapped_stores_equal_pwrite(tmp_path: Path, maps) -> None:
    f = _file()
    (tmp_path / "m").mkdir()
    (tmp_path / "p").mkdir()
    m = _write(f, tmp_path / "m", mapped=True)
    assert m.mapped and m._maps  # the mapped path really ran
    m.close()
    _write(f, tmp_path / "p", mapped=False).close()
    assert (tmp_path / "m" / f.name).read_bytes() == (tmp_path / "p" / f.name).read_bytes()


def test_a_kernel_that_cannot_populate_falls_back_to_pwrite(tmp_path: Path, monkeypatch, maps) -> None:  # fmt: skip
    monkeypatch.setattr(writer, "_MADV_POPULATE_WRITE", 12345)  # EINVAL, as before Linux 5.14
    f = _file()
    (tmp_path / "m").mkdir()
    (tmp_path / "p").mkdir()
    assert PieceWriter([f], tmp_path, mapped=True).mapped  # maps until the populate fails
    w = _write(f, tmp_path / "m", mapped=True)
    assert not w.mapped
    w.close()
    _write(f, tmp_path / "p", mapped=False).close()
    assert (tmp_path / "m" / f.name).read_bytes() == (tmp_path / "p" / f.name).read_bytes()


def test_a_full_tmpfs_is_enospc_not_sigbus(tmp_path: Path, maps) -> None:
    f = _file(8 << 20)
    with tmpfs(tmp_path / "small", "2m") as small:
        f.create(small / f.name)  # sized, not reserved, on tmpfs
        w = PieceWriter([f], small, mapped=True)
        try:
            with pytest.raises(OSError) as e:
                w.write("b", 0, torch.ones(6 << 20, dtype=torch.uint8))
            assert e.value.errno == errno.ENOSPC
        finally:
            w.close()


WAYS = {  # way of writing, worker start → the share of the output the workers hashed
    ("mmap", "fork"): (0.95, 1.0), ("mmap", "spawn"): (0.95, 1.0), ("pwrite", "fork"): (0.95, 1.0),
}  # fmt: skip


@pytest.mark.parametrize("recipe", ["ascend-hybrid", "bf16"])
def test_workers_writing_through_maps_or_pwrite_give_the_same_artifact(cli, tiny_ro: Path, tmp_path: Path, monkeypatch, recipe: str) -> None:  # fmt: skip
    """Two workers, each way of writing (the tmpfs default and the disk default), forked and
    spawned; either way the workers hash what they wrote as they store it
    (``tree_hashing.hashed_in_worker``): the bytes their nodes cover are nearly all (the
    headers, and the chunks two pieces share, are the parent's)."""
    outs = {}
    for (way, start), by_workers in WAYS.items():
        monkeypatch.setenv(writer.WRITE_ENV, way)
        monkeypatch.setenv("HETQUANT_WORKER_START", start)
        out = outs[way, start] = tmp_path / f"{way}-{start}"
        res = cli("-v", "convert", tiny_ro, out, "--recipe", recipe, "--workers", "2")
        assert res.exit_code == 0, res.stderr
        (timings,) = re.findall(r"hetquant\.convert: timings (\{.*\})", res.stderr)
        assert by_workers[0] <= json.loads(timings)["hashed_by_workers"] <= by_workers[1], way
    first, *others = outs.values()
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    for other in others:
        assert files == sorted(p.relative_to(other) for p in other.rglob("*") if p.is_file())
        for rel in files:  # the manifests too: the same digests
            assert (first / rel).read_bytes() == (other / rel).read_bytes(), (other, rel)


def test_a_destination_is_the_mapped_bytes_and_its_write_copies_nothing(tmp_path: Path, monkeypatch, maps) -> None:  # fmt: skip
    """A kernel computes into ``destination``'s array: the bytes land in the file, and the
    write of that very array copies nothing (``byte_view`` is never reached); another
    array at the same place is still copied."""
    f = _file()
    f.create(tmp_path / f.name)
    w = PieceWriter([f], tmp_path, mapped=True)
    dest = w.destination("b", 4093, (3, 1000), np.uint16)  # straddles pages, unaligned
    assert dest is not None and dest.shape == (3, 1000) and dest.flags.writeable
    want = np.arange(3000, dtype=np.uint16).reshape(3, 1000) * 7
    dest[:] = want
    copied: list[int] = []
    real = writer.byte_view
    monkeypatch.setattr(writer, "byte_view", lambda d: copied.append(1) or real(d))
    w.write("b", 4093, dest)
    assert not copied
    w.write("a", 0, np.array([5, 6, 7], dtype=np.int32))  # an ordinary array: copied
    assert copied == [1]
    del dest
    w.close()
    raw = (tmp_path / f.name).read_bytes()
    b0, a0 = f.offsets()["b"], f.offsets()["a"]
    assert raw[b0 + 4093 : b0 + 4093 + 6000] == want.tobytes()
    assert raw[a0 : a0 + 12] == np.array([5, 6, 7], dtype=np.int32).tobytes()


def test_no_destination_where_the_writer_does_not_map(tmp_path: Path) -> None:
    f = _file()
    f.create(tmp_path / f.name)
    w = PieceWriter([f], tmp_path, mapped=False)
    assert w.destination("b", 0, (4, 4), np.uint16) is None
    w.close()


def _digest_from(nodes: list, path: Path) -> tuple[str, int]:
    """The file's BLAKE3 from ``nodes`` (what they leave out read from the file), and the
    bytes the nodes cover."""
    data = path.read_bytes()
    tree = TreeDigest(len(data), data=np.frombuffer(data, np.uint8))
    for _, (first, k, cv) in nodes:
        tree.add_nodes(first, k, cv)
    return tree.hexdigest(), tree.hashed


@pytest.mark.skipif(not available(), reason="needs the BLAKE3 subtree kernel (a C++ compiler)")
@pytest.mark.parametrize("order", ["front-to-back", "shuffled"])
def test_a_hashing_writer_hashes_what_it_stores(tmp_path: Path, maps, order: str) -> None:
    """``hash_nodes``: the tree nodes hashed as pieces are stored give the file's one-shot
    BLAKE3; written front to back in odd sizes (each run continued across writes, slices of
    ``_SLICE``), they cover every byte of the run but the partial chunk it starts in."""
    f = _file(5 << 20)
    f.create(tmp_path / f.name)
    w = PieceWriter([f], tmp_path, mapped=True, hash_nodes=True)
    n = f.tensors[1].meta.nbytes
    cuts = sorted({0, n, *np.random.default_rng(1).integers(1, n, 40).tolist(), 1, 2, 1030})
    parts = list(itertools.pairwise(cuts))
    if order == "shuffled":
        np.random.default_rng(2).shuffle(parts)
    g = np.random.default_rng(3)
    for start, end in parts:
        w.write("b", start, g.integers(0, 256, end - start, dtype=np.uint8))
    w.write("a", 0, np.arange(3, dtype=np.int32))
    taken = w.take_nodes()
    assert taken is not None and taken[1] == n + 12
    assert w.take_nodes() == ([], 0)  # each take starts afresh
    w.close()
    path = tmp_path / f.name
    digest, covered = _digest_from(taken[0], path)
    assert digest == blake3.blake3(path.read_bytes()).hexdigest()
    if order == "front-to-back":  # "b" runs to the file's end: all of it but its first chunk
        b_start = f.offsets()["b"]
        assert covered >= f.size - -(-b_start // CHUNK) * CHUNK
    nodes = [(name, (first, k, cv.copy())) for name, (first, k, cv) in taken[0]]
    nodes[-1][1][2][0, 0] ^= 1
    assert _digest_from(nodes, path)[0] != digest  # the nodes are really used


@pytest.mark.skipif(not available(), reason="needs the BLAKE3 subtree kernel (a C++ compiler)")
def test_a_hashing_writer_hashes_what_it_pwrites(tmp_path: Path, monkeypatch, maps) -> None:
    """Where the kernel cannot populate (``pwrite`` from then on), the bytes are hashed from
    the writer's buffer as they are written: the same digest."""
    monkeypatch.setattr(writer, "_MADV_POPULATE_WRITE", 12345)  # EINVAL: pwrite from now on
    f = _file()
    f.create(tmp_path / f.name)
    w = PieceWriter([f], tmp_path, mapped=True, hash_nodes=True)
    n = f.tensors[1].meta.nbytes
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    for start in range(0, n, 777_777):
        w.write("b", start, data[start : start + 777_777])
    assert not w.mapped
    taken = w.take_nodes()
    w.close()
    assert taken is not None and taken[1] == n
    path = tmp_path / f.name
    digest, covered = _digest_from(taken[0], path)
    assert digest == blake3.blake3(path.read_bytes()).hexdigest()
    assert covered >= n - CHUNK  # one run: all of "b" but the chunk it starts in


def test_a_transposed_view_of_a_destination_is_written_not_taken_as_in_place(tmp_path: Path, maps) -> None:  # fmt: skip
    """Only a C-contiguous array at the destination's address is its bytes in place; a
    transposed view of it starts there too, and is stored (and hashed) as the bytes it holds."""
    f = _file(1 << 16)
    f.create(tmp_path / f.name)
    w = PieceWriter([f], tmp_path, mapped=True, hash_nodes=available())
    dest = w.destination("b", 0, (128, 256), np.uint16)
    assert dest is not None
    dest[:] = np.arange(128 * 256, dtype=np.uint16).reshape(128, 256)
    w.write("b", 0, dest.T.copy())  # expected bytes first: a plain write of the transpose
    expected = (tmp_path / f.name).read_bytes()
    dest[:] = np.arange(128 * 256, dtype=np.uint16).reshape(128, 256)
    w.take_nodes()
    w.write("b", 0, dest.T)  # starts at the destination, not C-contiguous
    taken = w.take_nodes()
    w.close()
    path = tmp_path / f.name
    assert path.read_bytes() == expected
    if available():
        assert taken is not None and _digest_from(taken[0], path)[0] == blake3.blake3(expected).hexdigest()  # fmt: skip


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of this process's mapping that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                flags = next(x for x in lines[i + 1 :] if x.startswith("VmFlags:"))
                return flags.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc only")
def test_the_output_maps_are_sequential_so_unmapping_marks_no_page_accessed(tmp_path: Path, maps) -> None:  # fmt: skip
    w = _write(_file(), tmp_path, mapped=True)
    (address,) = w._addr.values()
    assert "sr" in _vm_flags(address)  # VM_SEQ_READ: zap_pte_range skips folio_mark_accessed
    w.close()
