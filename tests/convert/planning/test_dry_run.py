"""``convert --dry-run`` with ``--calib-data``: the plan from headers alone — no calibration, nothing
written (the calibration itself is tested in tests/calib)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from support import TOOLS, tree_hashes

CALIBRATE = importlib.import_module("hetquant.calib.calibrate")  # the module, not the function


def _no_calibration(*args, **kwargs):
    raise AssertionError("--dry-run calibrated")


def test_dry_run_with_calib_data_neither_calibrates_nor_writes(
    tiny_ro: Path, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CALIBRATE, "calibrate", _no_calibration)
    out = tmp_path / "out"
    before = tree_hashes(tiny_ro)
    args = ["convert", tiny_ro, out, "--recipe", "awq-w4a16", "--calib-data", TOOLS / "calib.txt"]
    res = cli(*args, "--dry-run", "--calib-samples", "4", "--calib-seq-len", "64")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    assert re.search(r"^plan: \d+ jobs", res.stdout, re.M)
    assert f"calibration: AWQ on 4 x 64 tokens of {TOOLS / 'calib.txt'}, before the jobs" in res.stdout  # fmt: skip
    assert not out.exists()
    assert tree_hashes(tiny_ro) == before
    # the same command without --dry-run does calibrate (so the patch above is the one it calls)
    with pytest.raises(AssertionError, match="--dry-run calibrated"):
        res = cli(*args, "--calib-samples", "4", "--calib-seq-len", "64")
        raise res.exception


def test_dry_run_refuses_calib_data_for_a_recipe_that_does_not_calibrate(
    tiny_ro: Path, cli, tmp_path: Path
) -> None:
    res = cli("convert", tiny_ro, tmp_path / "out", "--recipe", "bf16", "--calib-data", TOOLS / "calib.txt", "--dry-run")  # fmt: skip
    assert res.exit_code == 2
    assert res.stderr == "error: recipe bf16 does not calibrate; drop --calib-data\n"
    assert not (tmp_path / "out").exists()
