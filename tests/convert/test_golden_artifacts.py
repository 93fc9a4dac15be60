"""Every recipe's artifact on the tiny model is byte-identical to the golden list (see
``golden_artifacts.py``); the manifest may only gain fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_artifacts import CASES, GOLDEN, convert

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
