"""How convert workers start (convert/engine/workers.py): forked where safe, else spawned, the same bytes
either way; a forked worker does not hold OUTPUT's lock."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import tree_hashes

from hetquant.convert.engine import workers
from hetquant.convert.fs.lock import OutputLock

TIMINGS = "hetquant.convert: timings "


def test_start_method(monkeypatch) -> None:
    monkeypatch.delenv(workers.START_ENV, raising=False)
    monkeypatch.setattr(workers.sys, "platform", "linux")
    monkeypatch.setattr(workers.torch.cuda, "is_initialized", lambda: False)
    assert workers.start_method() == "fork"
    monkeypatch.setattr(workers.torch.cuda, "is_initialized", lambda: True)  # a calibrated run
    assert workers.start_method() == "spawn"
    monkeypatch.setattr(workers.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(workers.sys, "platform", "darwin")
    assert workers.start_method() == "spawn"
    monkeypatch.setenv(workers.START_ENV, "fork")
    assert workers.start_method() == "fork"
    monkeypatch.setenv(workers.START_ENV, "SPAWN")
    assert workers.start_method() == "spawn"


def _timings(stderr: str) -> dict:
    line = next(x for x in stderr.splitlines() if TIMINGS in x)
    return json.loads(line.split(TIMINGS, 1)[1])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_forked_and_spawned_workers_write_the_same_artifact(
    cli, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path, monkeypatch, method: str
) -> None:
    monkeypatch.setenv(workers.START_ENV, method)
    out = tmp_path / "out"
    res = cli("-v", "convert", tiny_ro, out, "--recipe", "bf16", "--workers", "2")
    assert res.exit_code == 0, res.stderr
    t = _timings(res.stderr)
    assert t["start_method"] == method and t["workers_ready_s"] >= 0
    assert t["hashed_at_jobs_end"] <= 1.0 and t["jobs_s"] > 0
    assert tree_hashes(out) == tree_hashes(tiny_artifact)


def test_a_forked_child_closes_the_lock(tmp_path: Path) -> None:
    lock = OutputLock(tmp_path / "out").acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: its copy of the lock descriptor must be gone
            try:
                os.fstat(lock._fd)  # type: ignore[arg-type]
                os._exit(1)
            except OSError:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        os.fstat(lock._fd)  # type: ignore[arg-type]  # the parent's stays open
    finally:
        lock.release(remove=True)
