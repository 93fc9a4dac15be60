"""Every recipe's artifact on the tiny model, and the cases on the tiny vision-language models, is
byte-identical to the golden list (see ``golden_artifacts.py``); the manifest may only gain
fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from golden_artifacts import (
    CALIBRATED,
    CASE_SOURCES,
    CASES,
    GENERATED,
    GOLDEN,
    _example,
    convert,
    file_digests,
)

GOLDEN_DOC = json.loads(GOLDEN.read_text())


def _subset_diff(want: object, got: object, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` on ``want``'s keys (extra keys in ``got`` allowed)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in want for d in _subset_diff(want[k], got.get(k), f"{path}.{k}")]
    return [] if want == got else [f"{path}: {want!r} != {got!r}"]


PROCESSOR = {  # a VLM's processor files, which travel into every artifact (issue #28)
    "tiny-qwen3-vl-moe-bf16": {"preprocessor_config.json", "video_preprocessor_config.json",
                               "chat_template.jinja"},
    "tiny-qwen3-vl-moe-fp8": {"preprocessor_config.json", "video_preprocessor_config.json",
                              "chat_template.jinja"},
    "tiny-kimi-k25": {"preprocessor_config.json", "chat_template.jinja"},
}  # fmt: skip


def test_golden_cases_match_generator() -> None:
    assert set(GOLDEN_DOC) == set(CASES)
    assert all(GOLDEN_DOC[c]["args"] == CASES[c] for c in CASES)
    assert all(GOLDEN_DOC[c].get("source") == CASE_SOURCES.get(c) for c in CASES)
    for case, source in CASE_SOURCES.items():  # the processor files are pinned, as the source's
        entry = GOLDEN_DOC[case]
        assert all(entry["files"][f] == entry["source_files"][f] for f in PROCESSOR[source])


@pytest.mark.parametrize("case", sorted(CASES))
def test_artifact_bytes_equal_golden(case: str, tmp_path: Path) -> None:
    got = convert(case, tmp_path / case)
    want = GOLDEN_DOC[case]
    # a generated source first: a changed generator is not a changed converter
    assert got.get("source_files") == want.get("source_files"), "the tiny generator changed"
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


# Every tiny generator writes the same bytes under every ATen kernel (examples/tiny-tools/draw.py:
# torch.randn did not): the goldens' generated sources, and the generators only other tests use.
SOURCES: dict[str, Callable[[Path], Path]] = {
    **GENERATED,
    "tiny-qwen3-moe-fp8": lambda d: _example("tiny-qwen3-moe")["write_checkpoint"](d, "fp8"),
    "tiny-deepseek-v4": lambda d: _example("tiny-deepseek-v4")["write_checkpoint"](d),
}
_SOURCE_CHILD = """
import json, sys
from pathlib import Path
import torch
from test_golden_artifacts import SOURCES, file_digests
out = {n: file_digests(SOURCES[n](Path(sys.argv[1]) / n), skip="") for n in SOURCES}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "files": out}))
"""


def test_generated_sources_equal_on_scalar_aten_kernels(tmp_path: Path) -> None:
    env = {
        **os.environ,
        **OTHER_CPUS["scalar-sse42-1thread"],
        "PYTHONPATH": str(Path(__file__).parent),
    }
    done = subprocess.run(
        [sys.executable, "-c", _SOURCE_CHILD, str(tmp_path / "child")],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["capability"] == "DEFAULT"  # took effect
    golden = {CASE_SOURCES[c]: GOLDEN_DOC[c]["source_files"] for c in CASE_SOURCES}
    for name, write in SOURCES.items():
        here = file_digests(write(tmp_path / name), skip="")
        assert got["files"][name] == here, name
        assert name not in golden or here == golden[name], name
