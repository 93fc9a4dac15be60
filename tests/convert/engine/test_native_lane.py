"""The native lane (``convert/engine/native_jobs.py``): conversions whose every job has a kernel run
without torch and give the golden bytes; the torch code still takes what the kernels decline.

Each convert runs in a subprocess whose ``PYTHONPATH`` starts with a ``torch`` package that
raises on import, so the parent and every worker (forked or spawned) must do without it; the
parent then also checks ``'torch' not in sys.modules``. The fallback
(``HETQUANT_QUANT_BACKEND=torch``: no kernels) must import torch and give the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from golden_artifacts import CASES, GOLDEN, TINY, artifact_digest

from hetquant.convert import SourceCheckpoint, get_recipe, plan_for
from hetquant.convert.engine import writer
from hetquant.convert.engine.native_jobs import NativeJobs, needs_torch
from hetquant.convert.engine.writer import PieceWriter
from hetquant.convert.planning.plan import JobKind
from hetquant.formats import _quant_native as Q

GOLDEN_FILES = {case: doc["files"] for case, doc in json.loads(GOLDEN.read_text()).items()}
LANE = ("bf16", "bf16-1mb-shards", "ascend-hybrid", "ascend-hybrid-mtp-drop", "ascend-w8a8",
        "awq-w4a16", "awq-w4a16-g64", "fp4", "fp4-nvfp4")  # fmt: skip

# runs `hetquant ARGS`, then reports whether torch was imported ("torch: True|False")
_RUN = """
import sys
from hetquant.convert.cli import main
try:
    main(sys.argv[1:], prog_name="hetquant")
except SystemExit as e:
    if e.code:
        raise
print("torch:", "torch" in sys.modules)
"""


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not Q.available():
        pytest.skip(f"kernels unavailable: {Q.QUANT_LIBRARY.get().error}")


def _convert(case: str, out: Path, env: dict[str, str], *extra: str) -> str:
    args = ["convert", str(TINY), str(out), *CASES[case], *extra]
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, *args], env={**os.environ, **env},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _no_torch(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import torch`` raises."""
    blocker = tmp_path / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch imported in the native lane')\n")
    path = os.pathsep.join(filter(None, (str(blocker.parent), os.environ.get("PYTHONPATH"))))
    return {"PYTHONPATH": path}


@pytest.mark.parametrize(
    ("case", "workers", "start"),
    [(c, "1", "fork") for c in LANE]
    + [("bf16", "2", "fork"), ("ascend-hybrid", "2", "spawn"), ("fp4", "2", "spawn")],
)
def test_lane_converts_without_torch(case: str, workers: str, start: str, tmp_path: Path) -> None:
    env = {**_no_torch(tmp_path), "HETQUANT_WORKER_START": start}
    out = _convert(case, tmp_path / "out", env, "--workers", workers)
    assert "torch: False" in out
    assert artifact_digest(tmp_path / "out")["files"] == GOLDEN_FILES[case]


@pytest.mark.parametrize("case", ["bf16", "ascend-hybrid", "awq-w4a16", "fp4"])
def test_torch_fallback_gives_the_same_bytes(case: str, tmp_path: Path) -> None:
    out = _convert(case, tmp_path / "out", {"HETQUANT_QUANT_BACKEND": "torch"})
    assert "torch: True" in out  # the kernels were off: every job took the torch code
    assert artifact_digest(tmp_path / "out")["files"] == GOLDEN_FILES[case]


def test_a_recipe_without_kernels_imports_torch(tmp_path: Path) -> None:
    """ascend-w4a16 (ct_pack_quantized has no native quantize_array) is not on the lane: it
    needs torch, and gets it."""
    assert "torch: True" in _convert("ascend-w4a16", tmp_path / "out", {})
    assert artifact_digest(tmp_path / "out")["files"] == GOLDEN_FILES["ascend-w4a16"]


@pytest.mark.parametrize(
    ("recipe", "torch_needed"),
    [("bf16", False), ("ascend-w8a8", False), ("ascend-hybrid", False), ("awq-w4a16", False),
     ("fp4", False), ("ascend-w4a16", True)],
)  # fmt: skip
def test_needs_torch_from_the_plan(recipe: str, torch_needed: bool) -> None:
    """The parent's shape-only forecast: the lane's recipes need no torch, the others do."""
    source = SourceCheckpoint.open(TINY)
    jobs = plan_for(source, get_recipe(recipe), 1 << 40).jobs
    assert needs_torch(source, jobs) is torch_needed
    some = jobs[len(jobs) // 2]
    assert needs_torch(source, [some], calibrated=set(some.sources))  # calibrated: torch code


def test_the_pool_parent_imports_torch_once_for_its_workers(tmp_path: Path) -> None:
    """ascend-w4a16 on two forked workers: torch is imported in the parent before the fork
    (shared by the workers), not by each worker alone; the bytes are the golden ones."""
    env = {"HETQUANT_WORKER_START": "fork"}
    out = _convert("ascend-w4a16", tmp_path / "out", env, "--workers", "2")
    assert "torch: True" in out
    assert artifact_digest(tmp_path / "out")["files"] == GOLDEN_FILES["ascend-w4a16"]


def test_the_lane_absmax_is_the_torch_absmax() -> None:
    """``SourceCheckpoint.absmax_array`` (kernels) == ``absmax`` (torch) for every source weight
    an fp4 job reads; a merged group's jobs (an expert's gate and up) get one shared value,
    each member's absmax computed once."""
    source = SourceCheckpoint.open(TINY)
    jobs = [j for j in plan_for(source, get_recipe("fp4"), 1 << 40).jobs if j.amax_group]
    assert jobs
    lane = NativeJobs(source, None)  # type: ignore[arg-type]  # _absmax writes nothing
    calls: list[str] = []
    real = source.absmax_array
    source.absmax_array = lambda name: calls.append(name) or real(name)  # type: ignore[method-assign]
    for job in jobs:
        group = job.amax_group
        assert lane._absmax(job) == max(source.absmax(name) for name in group)
        for name in group:
            assert real(name) == source.absmax(name), name
    assert len(calls) == len(set(calls)) == len({n for j in jobs for n in j.amax_group})


def _lane_files(source, plan, work: Path, mapped: bool, lent: set[int]) -> dict[str, bytes]:
    """Every job of ``plan`` through the lane into ``work``; the kernels are lent destinations
    in the mapped output exactly for the jobs ``lent``, every destination comes back to the
    writer as the very array written (the kernel computed there), and none is copied again."""
    work.mkdir()
    for f in plan.files:
        f.create(work / f.name)
    out = PieceWriter(plan.files, work, mapped=mapped)
    lane, given, copied, written = NativeJobs(source, out), [], [], set()
    real_dest, real_view, real_write = out.destination, writer.byte_view, out.write

    def destination(*args):
        given.append(real_dest(*args))
        return given[-1]

    def write(tensor, offset, data):
        if isinstance(data, np.ndarray):
            written.add(data.ctypes.data)
        return real_write(tensor, offset, data)

    def byte_view(data):
        copied.append(data.ctypes.data if hasattr(data, "ctypes") else None)
        return real_view(data)

    out.destination = destination  # type: ignore[method-assign]
    out.write = write  # type: ignore[method-assign]
    writer.byte_view = byte_view
    try:
        for job in plan.jobs:
            n = len(given)
            assert lane.run(job), job
            assert any(a is not None for a in given[n:]) is (mapped and job.id in lent), job
    finally:
        writer.byte_view = real_view
    in_place = {a.ctypes.data for a in given if a is not None}
    assert len(in_place) == len(given) if mapped else not in_place  # each block row its own
    assert not in_place & set(copied)
    assert in_place <= written  # computed in place, not into a fresh array then copied
    given.clear()
    out.close()
    return {f.name: (work / f.name).read_bytes() for f in plan.files}


def _in_place(source, job) -> bool:
    """Whether the lane computes a job's rows straight into the mapped output: FP8 dequantized
    there into a BF16 target, or a format's rows quantized there (W8A8's codes, the INT4
    experts' packed rows). Tensors assembled whole (AWQ, NVFP4 tiled) are not."""
    fmt = job.target.fmt
    if job.kind is JobKind.EXPERTS:
        return fmt.native_rows_into
    if job.kind is not JobKind.LINEAR:
        return False
    chunk = fmt.streaming(source.tensors[job.source].shape).chunk_format
    fp8_to_bf16 = source.tensors[job.source].fmt is not None and chunk.stores_bf16_rows
    return fp8_to_bf16 or "weight" in chunk.quantizes_rows_into


# (recipe, tiny model): square experts, and the trained model's [128, 384] gates and [384, 128]
# downs (whose gates fit no Ascend FP4 tile, so fp4 refuses it; awq has nothing in place)
IN_PLACE_CASES = [(r, "tiny-deepseek-v3") for r in ("bf16", "ascend-w8a8", "ascend-hybrid", "awq-w4a16", "fp4")]  # fmt: skip
IN_PLACE_CASES += [(r, "tiny-deepseek-v3-trained") for r in ("bf16", "ascend-w8a8", "ascend-hybrid")]  # fmt: skip


@pytest.mark.parametrize(("recipe", "model"), IN_PLACE_CASES)
def test_outputs_are_computed_in_place_in_a_mapped_output(recipe: str, model: str, tmp_path: Path, monkeypatch) -> None:  # fmt: skip
    """Through a mapped writer the kernels compute into the output's pages
    (``PieceWriter.destination``; ``_in_place`` says which jobs), none of those bytes is copied
    afterwards, and the files are byte for byte the ``pwrite`` ones — with square experts and
    with experts whose down is [384, 128] (the trained tiny model)."""
    monkeypatch.setenv(writer.WRITE_ENV, "mmap")
    source = SourceCheckpoint.open(TINY.parent / model)
    plan = plan_for(source, get_recipe(recipe), 1 << 40)
    lent = {j.id for j in plan.jobs if _in_place(source, j)}
    assert bool(lent) is (recipe != "awq-w4a16")  # its every weight is assembled whole
    mapped = _lane_files(source, plan, tmp_path / "mapped", True, lent)
    assert mapped == _lane_files(source, plan, tmp_path / "pwrite", False, lent)
