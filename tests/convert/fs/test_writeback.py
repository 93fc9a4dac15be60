"""The write-back queue (convert/fs/writeback.py): whole pages only, in the order handed in, one
descriptor per file, and nothing after close; a conversion hands it every piece it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetquant.convert.fs import writeback
from hetquant.convert.fs.writeback import PAGE, WritebackQueue, whole_pages


def test_whole_pages_stay_inside_the_range() -> None:
    assert whole_pages(0, 3 * PAGE) == (0, 3 * PAGE)
    assert whole_pages(1, 3 * PAGE) == (PAGE, 2 * PAGE)
    assert whole_pages(PAGE - 1, 2) == (PAGE, 0)
    assert whole_pages(5, 10) == (PAGE, 0)


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    monkeypatch.setattr(
        writeback, "_CALL", lambda fd, first, n, flags: out.append((fd, first, n, flags))
    )
    return out


def test_ranges_go_out_in_order_on_whole_pages(tmp_path: Path, calls) -> None:
    for name in "ab":
        (tmp_path / name).write_bytes(bytes(10 * PAGE))
    q = WritebackQueue({"a": tmp_path / "a", "b": tmp_path / "b"})
    q.start()
    q.add("a", 3 * PAGE + 7, 6 * PAGE)
    q.add("b", 0, 2 * PAGE)
    q.add("a", 0, 5)  # no whole page: nothing handed over
    q.add("a", 0, 3 * PAGE + 7)
    q._queue.put(None)  # let the thread finish what is queued, as the end of a run would
    q._thread.join()
    q._thread = None
    fds = {c[0] for c in calls}
    assert [(c[1], c[2], c[3]) for c in calls] == [
        (4 * PAGE, 2 * PAGE, 2), (0, 2 * PAGE, 2), (0, 3 * PAGE, 2)
    ]  # fmt: skip
    assert len(fds) == 2 and calls[0][0] == calls[2][0] != calls[1][0]
    q.close()


def test_close_drops_what_is_queued_and_a_vanished_file_is_no_error(tmp_path: Path, calls) -> None:
    q = WritebackQueue({"gone": tmp_path / "gone"})
    q.start()
    q.add("gone", 0, 4 * PAGE)  # open fails: left to the file's fsync, no exception
    q.close()
    q.add("gone", 0, 4 * PAGE)  # after close: ignored
    assert calls == []


def test_a_conversion_hands_every_written_piece_to_the_queue(tmp_path: Path, monkeypatch) -> None:
    """FileHashes.written passes each job's byte ranges on, in the order jobs report them."""
    from hetquant.convert.engine import hashing

    seen: list[tuple[str, int, int]] = []
    monkeypatch.setattr(WritebackQueue, "add", lambda self, n, s, e: seen.append((n, s, e)))
    plan = _tiny_plan(tmp_path)
    h = hashing.FileHashes(plan, tmp_path, threads=1)
    where = hashing._where(plan)
    for job in plan.jobs:
        h.written(job)
    h.close()
    assert seen == [r for job in plan.jobs for r in hashing._ranges(job, where)]
    assert seen


def _tiny_plan(tmp_path: Path):
    from support import TINY  # the embedded tiny DeepSeek-V3

    from hetquant.convert import SourceCheckpoint, get_recipe, plan_for

    return plan_for(SourceCheckpoint.open(TINY), get_recipe("ascend-hybrid"), 64_000)
