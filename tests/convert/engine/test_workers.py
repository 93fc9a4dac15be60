"""How convert workers start (convert/engine/workers.py): forked where safe, else spawned, the same bytes
either way; a forked worker does not hold OUTPUT's lock; a worker keeps the heap it frees."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
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


_HEAP_PROBE = """
import ctypes, sys
from hetquant.convert.engine.workers import keep_freed_heap

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def cycle(n):  # what a job does with a block-row buffer: take it, free it
    before = libc.mallinfo2().hblks
    p = libc.malloc(n)
    taken = libc.mallinfo2()
    libc.free(p)
    # (maps made for it, heap given back at its free)
    return taken.hblks - before, libc.mallinfo2().arena < taken.arena

if sys.argv[1] == "kept":
    assert keep_freed_heap()
print(*cycle(8 << 20), cycle(40 << 20)[0])
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc >= 2.33")
def test_a_worker_keeps_the_heap_it_frees() -> None:
    """An 8 MiB block-row buffer: glibc's defaults (no ``MALLOC_*`` tunables) give it its own map,
    returned at free; after ``keep_freed_heap`` it comes from the heap, which does not give it
    back (the trim threshold: the mmap threshold alone would leave glibc's 128 KiB one); 40 MiB
    still maps."""

    def probe(mode: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}  # fmt: skip
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True, env=env)  # fmt: skip
        return out.stdout.split()

    assert probe("default") == ["1", "False", "1"]
    assert probe("kept") == ["0", "False", "1"]
