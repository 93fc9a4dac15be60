"""Every recipe's artifact on the tiny model is byte-identical to the golden list (see
``golden_artifacts.py``); the manifest may only gain fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden_artifacts import CALIBRATED, CASES, GOLDEN, convert

GOLDEN_DOC = json.loads(GOLDEN.read_text())


def _subset_diff(want: object, got: object, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` on ``want``'s keys (extra keys in ``got`` allowed)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in want for d in _subset_diff(want[k], got.get(k), f"{path}.{k}")]
    return [] if want == got else [f"{path}: {want!r} != {got!r}"]


def test_golden_cases_match_generator() -> None:
    assert set(GOLDEN_DOC) == set(CASES)
    assert all(GOLDEN_DOC[c]["args"] == CASES[c] for c in CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_artifact_bytes_equal_golden(case: str, tmp_path: Path) -> None:
    got = convert(case, tmp_path / case)
    want = GOLDEN_DOC[case]
    assert got["files"] == want["files"]
    assert _subset_diff(want["manifest"], got["manifest"]) == []


# Calibrated artifacts are the same bytes on every CPU (calib/awq.py, "Reproducibility"): the
# calibrated cases again under other ATen kernels (ATEN_CPU_CAPABILITY), other MKL kernels
# (MKL_ENABLE_INSTRUCTIONS: the paths MKL takes on other CPUs) and thread counts, in a child
# each (both are read when torch loads). The in-process test above covers this CPU's own paths.
OTHER_CPUS = {
    "scalar-sse42-1thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "OMP_NUM_THREADS": "1",
    },
    "avx2-2threads": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OMP_NUM_THREADS": "2",
    },
}
_CHILD = """
import json, sys
from pathlib import Path
import torch
from golden_artifacts import CALIBRATED, convert
out = {c: convert(c, Path(sys.argv[1]) / c)["files"] for c in CALIBRATED}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "files": out}))
"""


@pytest.mark.parametrize("paths", sorted(OTHER_CPUS))
def test_calibrated_bytes_equal_golden_on_other_cpu_paths(paths: str, tmp_path: Path) -> None:
    env = {**os.environ, **OTHER_CPUS[paths], "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["capability"] == OTHER_CPUS[paths]["ATEN_CPU_CAPABILITY"].upper()  # took effect
    for case in CALIBRATED:
        assert got["files"][case] == GOLDEN_DOC[case]["files"], case
