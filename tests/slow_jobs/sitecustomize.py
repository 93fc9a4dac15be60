"""Test-only start-up hook (on ``PYTHONPATH`` only for children that ``support.start_hetquant``
starts with ``slow_jobs``): with ``HETQUANT_TEST_SLOW_JOBS=seconds`` set, every
``JobRunner.run`` sleeps half that time before and half after the real work — in the command's
process and in every worker it spawns, which import this file too — so that the tiny model can
be killed mid-run, also after a job's bytes are written but before the journal records it."""

import os
import time

_DELAY = os.environ.get("HETQUANT_TEST_SLOW_JOBS")
if _DELAY:
    from hetquant.convert import jobs

    _run, _half = jobs.JobRunner.run, float(_DELAY) / 2

    def _slow_run(self, job):
        time.sleep(_half)
        n = _run(self, job)
        time.sleep(_half)
        return n

    jobs.JobRunner.run = _slow_run
