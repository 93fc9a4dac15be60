"""``hetquant run`` when a rank fails, hangs or the ranks cannot meet: one error line, soon —
never torch's 30-minute connection retry or a traceback. (Issue 25 §5.)

The faults are made inside the spawned ranks by ``tests/child_hooks`` (``HETQUANT_TEST_RANK``);
each child runs under a generous timeout that only guards against a hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support import CHILD_HOOKS, REPO

from hetquant.formats import HetquantError
from hetquant.runtime.serving.collectives import join_store, rendezvous

HANG_GUARD = 300  # seconds; not a performance threshold
RUN = """
import sys
from hetquant.formats import HetquantError
from hetquant.runtime.serving.run import RunSpec, run_artifact
if __name__ == "__main__":
    try:
        run_artifact(RunSpec(sys.argv[1], (5, 17), tp=2, join_timeout=5))
    except HetquantError as e:
        sys.exit(f"error: {e}")
"""


def _child(args: list[str], fault: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HETQUANT_TEST_RANK=fault)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHILD_HOOKS), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO,
        timeout=HANG_GUARD,
    )  # fmt: skip


def test_a_rank_that_never_joins_ends_the_run_after_the_join_timeout(
    tiny_artifact: Path, tmp_path: Path
) -> None:
    script = tmp_path / "run.py"  # a file: spawned ranks re-import the parent's main module
    script.write_text(RUN)
    res = _child([str(script), str(tiny_artifact)], "1:hang")
    assert res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == "error: run: rank 0 of 2: rank(s) [1] did not join within 5 s (did one die or hang on its way?)", res.stderr  # fmt: skip
    assert "Traceback" not in res.stderr


def test_a_rank_raising_an_unexpected_error_is_one_line(tiny_artifact: Path) -> None:
    main = "import sys; from hetquant.convert.cli import main; sys.exit(main())"
    res = _child(["-c", main, "run", str(tiny_artifact), "--tokens", "5,17", "--tp", "2"], "1:raise")  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "Terminating process" not in res.stderr
    lines = [x for x in res.stderr.splitlines() if not x.startswith("INFO ")]
    assert lines == ["error: run: rank 1 of 2 failed: RuntimeError: a fault the test hook made"]


def test_a_store_that_is_not_there_is_one_line_after_the_timeout() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HetquantError, match=rf"rank 0 of 2 cannot reach the ranks' store on 127.0.0.1:{port}"):  # fmt: skip
        join_store(port, 1, 0, 2)


def test_the_parents_store_takes_a_port_of_its_own() -> None:
    """No free port to guess (and lose to another process): the OS picks it, the parent holds
    it, and a rank alone in its world joins at once."""
    store = rendezvous(5)
    assert store.port > 0
    joined = join_store(store.port, 5, 0, 1)
    assert joined.check(["hetquant/joined/0"])
