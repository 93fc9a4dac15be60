"""Containers hashed while the jobs run (convert/engine/hashing.py front to back, tree_hashing.py
out of order): the digests equal a hash of the finished file whatever order jobs finish in, with
resumed jobs, bytes no job writes, and the waves of files filled front to back."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import blake3
import pytest
import torch

from hetquant.convert import SourceCheckpoint, file_digest, get_recipe, make_plan, plan_for
from hetquant.convert.engine import writer
from hetquant.convert.engine.hashing import FileHashes, _where, fill_order
from hetquant.convert.engine.tree_hashing import TreeHashes, container_hashes, hashed_in_worker
from hetquant.convert.engine.writer import PieceWriter
from hetquant.formats.blake3_tree import CHUNK
from hetquant.formats.file_digests import DIGESTS, DigestAlgorithm

ONE_SHOT = {"sha256": hashlib.sha256, "blake3": blake3.blake3}

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def plan():
    """The hybrid plan of the tiny model in 64 kB root shards: many files, stacked experts."""
    return plan_for(SourceCheckpoint.open(TINY), get_recipe("ascend-hybrid"), 64_000)


def _fill(plan, work: Path, jobs, seed: int) -> None:
    """Write every piece of ``jobs`` with bytes that depend on the piece (not zeros)."""
    w = PieceWriter(plan.files, work, mapped=False)
    for job in jobs:
        for p in job.outputs:
            g = torch.Generator().manual_seed(seed + job.id)
            w.write(p.tensor, p.offset, torch.randint(0, 256, (p.meta.nbytes,), generator=g, dtype=torch.uint8))  # fmt: skip
    w.close()


def _tree(plan, work: Path, threads: int = 2) -> TreeHashes:
    return TreeHashes(plan, work, threads)


HASHERS = {"prefix": lambda plan, work: FileHashes(plan, work, 2), "tree": _tree}


def _create(plan, work: Path) -> None:
    for f in plan.files:
        f.create(work / f.name)


@pytest.mark.parametrize(("threads", "alg", "per_file"), [(1, "blake3", 1), (3, "blake3", 4), (3, "sha256", None), (1, "tree", None), (4, "tree", None)])  # fmt: skip
def test_digests_equal_the_finished_files_in_any_completion_order(plan, tmp_path: Path, threads: int, alg: str, per_file: int | None) -> None:  # fmt: skip
    """Streamed while written, in any order, then the tail: the digest of the finished file
    hashed from scratch in one call (and what ``file_digest`` gives)."""
    _create(plan, tmp_path)
    jobs = list(plan.jobs)
    random.Random(threads).shuffle(jobs)
    if alg == "tree":
        hashes, alg = TreeHashes(plan, tmp_path, threads), "blake3"
    else:
        hashes = FileHashes(plan, tmp_path, threads, DIGESTS[alg], per_file)
    resumed, run = jobs[:5], jobs[5:]
    _fill(plan, tmp_path, resumed, 0)
    for job in resumed:  # a resume marks what the journal holds before anything runs
        hashes.written(job)
    hashes.start()
    for job in run:
        _fill(plan, tmp_path, [job], 0)
        hashes.written(job)
    digests = hashes.finish()
    assert digests == {f.name: file_digest(tmp_path / f.name, DIGESTS[alg]) for f in plan.files}
    for f in plan.files:
        data = (tmp_path / f.name).read_bytes()
        assert digests[f.name] == {"size": len(data), alg: ONE_SHOT[alg](data).hexdigest()}


@pytest.mark.parametrize("kind", sorted(HASHERS))
def test_bytes_no_job_wrote_are_hashed_at_the_end(plan, tmp_path: Path, kind: str) -> None:
    _create(plan, tmp_path)
    skipped = plan.jobs[len(plan.jobs) // 2]
    hashes = HASHERS[kind](plan, tmp_path)
    hashes.start()
    for job in plan.jobs:
        if job is not skipped:
            _fill(plan, tmp_path, [job], 1)
            hashes.written(job)
    assert hashes.finish() == {f.name: file_digest(tmp_path / f.name) for f in plan.files}


@pytest.mark.parametrize("kind", sorted(HASHERS))
def test_a_missing_file_is_an_os_error_from_finish(plan, tmp_path: Path, kind: str) -> None:
    _create(plan, tmp_path)
    (tmp_path / plan.files[0].name).unlink()
    hashes = HASHERS[kind](plan, tmp_path)
    with pytest.raises(FileNotFoundError):
        hashes.finish()


def test_fill_order_waves_then_position_in_file(plan) -> None:
    width = 2
    order = fill_order(plan, list(plan.jobs), width)
    assert sorted(j.id for j in order) == [j.id for j in plan.jobs]
    file_of = plan.file_of()
    stacked = [f.name for f in plan.files if f.part != "root"]  # expert e writes rows far apart
    assert stacked and order[0].kind == "experts"
    index = {n: i for i, n in enumerate(stacked + [f.name for f in plan.files if f.part == "root"])}
    waves = [min(index[file_of[o.tensor].name] for o in j.outputs) // width for j in order]
    assert waves == sorted(waves)  # a wave's files are filled before the next wave starts
    first = {f.name: f.offsets() for f in plan.files}
    for wave in set(waves):  # within a wave, jobs go front to back in their files
        rel = [
            min(first[file_of[o.tensor].name][o.tensor] + o.offset for o in j.outputs)
            / file_of[j.outputs[0].tensor].size
            for j, w in zip(order, waves, strict=True)
            if w == wave
        ]
        assert rel == sorted(rel)


@pytest.mark.parametrize("kind", sorted(HASHERS))
def test_a_file_of_only_a_header_is_hashed(tmp_path: Path, kind: str) -> None:
    empty = make_plan([], get_recipe("bf16"), 1 << 30)  # one shard without tensors
    _create(empty, tmp_path)
    assert HASHERS[kind](empty, tmp_path).finish() == {f.name: file_digest(tmp_path / f.name) for f in empty.files}  # fmt: skip


def test_the_tree_hashes_pieces_before_the_jobs_end(plan, tmp_path: Path) -> None:
    """Out of order: with the jobs reported last-file-first and back to front, nearly every
    byte is hashed before ``finish`` (what the prefix hasher could not do: no prefix is complete)."""
    _create(plan, tmp_path)
    hashes = TreeHashes(plan, tmp_path, 2)
    hashes.start()
    for job in reversed(plan.jobs):
        _fill(plan, tmp_path, [job], 3)
        hashes.written(job)
    hashes._wait()
    total = sum(f.size for f in plan.files)
    assert hashes.hashed_bytes() >= 0.9 * total
    assert hashes.finish() == {f.name: file_digest(tmp_path / f.name) for f in plan.files}


def test_a_conversion_hashes_with_the_tree_where_it_is_built(plan, tmp_path: Path, monkeypatch) -> None:  # fmt: skip
    assert isinstance(container_hashes(plan, tmp_path, 2), TreeHashes)
    monkeypatch.setenv("HETQUANT_TREE_HASH", "0")
    assert isinstance(container_hashes(plan, tmp_path, 2), FileHashes)


@pytest.mark.parametrize("alg", sorted(DIGESTS))
def test_stream_then_bulk_reads_of_odd_sizes_give_the_one_shot_digest(plan, tmp_path: Path, alg: str) -> None:  # fmt: skip
    """Reads that straddle every piece boundary: small ones while jobs run, larger ones (on a
    pool of threads) after ``finish``: the digest is the file's, hashed from scratch."""
    odd = DigestAlgorithm(alg, DIGESTS[alg].new, 997, 7919)
    _create(plan, tmp_path)
    hashes = FileHashes(plan, tmp_path, 2, odd, per_file=3)
    hashes.start()
    half = len(plan.jobs) // 2
    for job in plan.jobs[:half]:
        _fill(plan, tmp_path, [job], 2)
        hashes.written(job)
    _fill(plan, tmp_path, plan.jobs[half:], 2)  # written, not yet marked: hashed by finish
    digests = hashes.finish()
    for f in plan.files:
        data = (tmp_path / f.name).read_bytes()
        assert digests[f.name] == {"size": len(data), alg: ONE_SHOT[alg](data).hexdigest()}


def test_nodes_hashed_by_the_writing_worker_give_the_same_digests(plan, tmp_path: Path, monkeypatch) -> None:  # fmt: skip
    """Jobs whose writer mapped the output hand over the tree nodes it hashed as it stored
    them (``hashed_in_worker``); the others are read back. Digests: the one-shot BLAKE3 of each
    file. With the map's bytes wrong, the digest is wrong: the nodes are really used."""
    monkeypatch.setenv(writer.WRITE_ENV, "mmap")
    _create(plan, tmp_path)
    out = PieceWriter(plan.files, tmp_path, mapped=True, hash_nodes=True)
    where, hashes = _where(plan), TreeHashes(plan, tmp_path, 2)
    hashes.start()
    jobs = list(plan.jobs)
    random.Random(3).shuffle(jobs)
    for i, job in enumerate(jobs):
        w = out if i % 3 else PieceWriter(plan.files, tmp_path, mapped=False)
        for p in job.outputs:
            g = torch.Generator().manual_seed(job.id)
            w.write(p.tensor, p.offset, torch.randint(0, 256, (p.meta.nbytes,), generator=g, dtype=torch.uint8))  # fmt: skip
        nodes = hashed_in_worker(w, job)
        assert (nodes is None) is (w is not out), job
        hashes.hashed_elsewhere(job.id, nodes)
        hashes.written(job)
        if w is not out:
            w.close()
    digests = hashes.finish()
    out.close()
    for f in plan.files:
        data = (tmp_path / f.name).read_bytes()
        assert digests[f.name] == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    big = max(plan.jobs, key=lambda j: sum(p.meta.nbytes for p in j.outputs))
    nothing = PieceWriter(plan.files, tmp_path, mapped=True, hash_nodes=True)
    assert hashed_in_worker(nothing, big) is None  # it stored none of the job's bytes
    mapped = PieceWriter(plan.files, tmp_path, mapped=True, hash_nodes=True)
    for piece in big.outputs:  # stored as they are, in writes of odd sizes
        name, base = where[piece.tensor][0].name, where[piece.tensor][1] + piece.offset
        data = (tmp_path / name).read_bytes()[base : base + piece.meta.nbytes]
        for at in range(0, len(data), 3001):
            mapped.write(piece.tensor, piece.offset + at, data[at : at + 3001])
    nodes = hashed_in_worker(mapped, big)
    mapped.close()
    assert nodes is not None and len(nodes[0][0])
    nodes[0][2][0, 0] ^= 1  # one bit of one chaining value
    name = where[big.outputs[0].tensor][0].name
    hashes = TreeHashes(plan, tmp_path, 1)
    for job in plan.jobs:
        hashes.hashed_elsewhere(job.id, nodes if job is big else None)
        hashes.written(job)
    assert hashes.finish()[name]["blake3"] != digests[name]["blake3"]


def test_nodes_over_the_same_bytes_twice_are_not_taken(plan, tmp_path: Path, monkeypatch) -> None:  # fmt: skip
    """A job whose writer stored a piece's first 2 KiB twice and left its last 2 KiB out (so
    the byte count still matches) gives overlapping nodes: ``hashed_in_worker`` refuses them,
    and the parent reads the ranges back. Stored as planned, they are taken."""
    monkeypatch.setenv(writer.WRITE_ENV, "mmap")
    _create(plan, tmp_path)
    job = next(j for j in plan.jobs if j.outputs[0].meta.nbytes >= 8 * CHUNK)
    w = PieceWriter(plan.files, tmp_path, mapped=True, hash_nodes=True)
    data = {
        p.tensor: torch.randint(0, 256, (p.meta.nbytes,), dtype=torch.uint8) for p in job.outputs
    }

    def store(p, start: int, end: int) -> None:
        w.write(p.tensor, p.offset + start, data[p.tensor][start:end])

    first, h = job.outputs[0], 2 * CHUNK
    n = first.meta.nbytes
    for start, end in [(0, h), (0, h), (h, n - h)]:
        store(first, start, end)
    for p in job.outputs[1:]:
        store(p, 0, p.meta.nbytes)
    assert hashed_in_worker(w, job) is None
    for p in job.outputs:
        store(p, 0, p.meta.nbytes)
    assert hashed_in_worker(w, job) is not None
    w.close()


def test_a_tmpfs_output_is_filled_a_file_per_worker_a_disk_by_the_hash_width(tmp_path: Path, monkeypatch) -> None:  # fmt: skip
    from hetquant.convert.engine import hashing

    monkeypatch.setattr(hashing, "memory_backed", lambda path: path == tmp_path / "mem")
    assert hashing.fill_width(8, 16, tmp_path / "mem") == 16  # a file's page-cache lock each
    assert hashing.fill_width(8, 4, tmp_path / "mem") == 8  # never narrower than the hashing
    assert hashing.fill_width(8, 1, tmp_path / "mem") == 8  # in-process: no other writer
    assert hashing.fill_width(8, 16, tmp_path / "disk") == 8  # fewer files in write-back


def test_the_conversion_fills_as_wide_as_fill_width_says(tmp_path: Path, monkeypatch) -> None:
    from hetquant.convert.engine import convert as engine

    asked, widths = [], []
    real = engine.fill_order
    monkeypatch.setattr(engine, "fill_width", lambda width, workers, work: asked.append((width, workers, work)) or 5)  # fmt: skip
    monkeypatch.setattr(engine, "fill_order", lambda p, jobs, width: widths.append(width) or real(p, jobs, width))  # fmt: skip
    out = tmp_path / "out"
    engine.convert(SourceCheckpoint.open(TINY), out, get_recipe("bf16"), max_shard_size=64_000, workers=2)  # fmt: skip
    ((width, workers, work),) = asked
    assert (width, workers) == (engine.hash_threads(), 2) and out in work.parents  # its work dir
    assert widths == [5]
