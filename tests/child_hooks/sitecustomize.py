"""Test-only start-up hooks, on ``PYTHONPATH`` only for the children ``support.start_hetquant``
starts with them; they act in the command's process and in every worker it spawns (which import
this file too). Test code only: hetquant itself is unchanged.

- ``HETQUANT_TEST_SLOW_JOBS=seconds``: every ``JobRunner.run`` sleeps half that time before and
  half after the real work, so the tiny model can be killed mid-run, also after a job's bytes are
  written but before the journal records it.
- ``HETQUANT_TEST_KILL_WORKERS=SIGNAL``: a worker process sends itself that signal when it
  takes its first job (as the out-of-memory killer would).
- ``HETQUANT_TEST_TRUNCATE=path``: the first job that reads source file ``path`` maps it, then
  empties it just before reading (after the engine's own check of the source), so that the read
  hits a memory map past the end of its file: SIGBUS.
- ``HETQUANT_TEST_RANK=N:hang`` / ``N:raise``: rank N of a ``hetquant run`` never joins the
  ranks' store (sleeps) / raises a RuntimeError where it would join it.
"""

import multiprocessing
import os
import signal
import time

_DELAY = os.environ.get("HETQUANT_TEST_SLOW_JOBS")
_TRUNCATE = os.environ.get("HETQUANT_TEST_TRUNCATE")
_KILL = os.environ.get("HETQUANT_TEST_KILL_WORKERS")

if _DELAY or _TRUNCATE or _KILL:
    from hetquant.convert.engine import jobs
    from hetquant.convert.fs.source_guard import job_files

    _run = jobs.JobRunner.run
    _half = float(_DELAY or 0) / 2

    def _hooked_run(self, job):
        if _KILL and multiprocessing.parent_process() is not None:  # a worker, not the command
            os.kill(os.getpid(), signal.Signals[_KILL])
        time.sleep(_half)
        if _TRUNCATE and os.path.basename(_TRUNCATE) in job_files(self.source, job):
            if os.path.getsize(_TRUNCATE):
                for name in job.sources:  # map its files first (maps are made on first use)
                    self.source.stored(name)
                os.truncate(_TRUNCATE, 0)
        n = _run(self, job)
        time.sleep(_half)
        return n

    jobs.JobRunner.run = _hooked_run


_RANK = os.environ.get("HETQUANT_TEST_RANK")
if _RANK:
    from hetquant.runtime.serving import collectives

    _join_store = collectives.join_store
    _which, _how = _RANK.split(":")

    def _hooked_join_store(port, timeout_s, rank, world):
        if rank == int(_which):
            if _how == "hang":
                time.sleep(3600)
            raise RuntimeError("a fault the test hook made")
        return _join_store(port, timeout_s, rank, world)

    collectives.join_store = _hooked_join_store
