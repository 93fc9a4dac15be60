"""A load is all-old, all-new or an error while a convert replaces the artifact
(``runtime/loading/_pin.py``; issue 25 §4, item 1).

Two tiny bf16 artifacts in 1 MB shards of the same names that differ in every quantized
tensor's values: A, and B (the source's FP8 scales doubled). They replace each
other in one directory through the convert's own transaction (``move.move_in``), from
complete copies staged in its work directory — as ``convert --overwrite`` ends — with loads in
between or at the same time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import PARTIAL, REPO, TINY, resave_shard, run_cli

from hetquant.convert.engine.move import move_in
from hetquant.formats import HetquantError
from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.loading import _reader, loader
from hetquant.runtime.loading._pin import Replaced

HANG_GUARD = 300  # seconds, for the child; not a performance threshold
SWAPS, MAX_LOADS = 120, 300


def _stage(src: Path, out: Path) -> None:
    """A complete copy of artifact ``src`` in ``out``'s work directory (new inodes, as a
    convert's), then moved in."""
    work = out / PARTIAL
    for p in sorted(src.rglob("*")):
        if p.is_file():
            (work / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, work / p.relative_to(src))
    move_in(out, work)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pin")
    src_b = base / "src-b"
    shutil.copytree(TINY, src_b)
    for shard in sorted(src_b.glob("*.safetensors")):
        resave_shard(shard, _double_scales)
    out = {"A": base / "A", "B": base / "B"}
    for name, src in (("A", TINY), ("B", src_b)):
        res = run_cli("convert", src, out[name], "--recipe", "bf16", "--max-shard-size", "1MB")
        assert res.exit_code == 0, res.stderr
    return out


def _double_scales(tensors: dict[str, torch.Tensor]) -> None:
    for k in tensors:
        if k.endswith("weight_scale_inv"):
            tensors[k] = tensors[k] * 2


def _load(path: Path) -> dict[str, torch.Tensor]:
    return open_artifact(path).load(ParallelLayout())


@pytest.fixture(scope="module")
def loads(two: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    return {k: {n: t.clone() for n, t in _load(p).items()} for k, p in two.items()}


def _which(got: dict[str, torch.Tensor], loads: dict[str, dict[str, torch.Tensor]]) -> str:
    """ "A" or "B" when ``got`` is that artifact's load, wholly; else "mixed"."""
    for name, want in loads.items():
        if got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want):
            return name
    return "mixed"


def test_the_two_artifacts_differ(loads) -> None:
    a, b = loads["A"], loads["B"]
    assert a.keys() == b.keys()
    assert sum(not torch.equal(a[n], b[n]) for n in a) > len(a) // 2


def test_a_load_after_a_replacement_is_refused(two, loads, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(two["A"], out)
    art = open_artifact(out)
    _stage(two["B"], out)
    with pytest.raises(Replaced, match="the artifact was replaced since it was opened"):
        art.load(ParallelLayout())
    assert _which(_load(out), loads) == "B"  # opened again: the new one, whole


def test_a_replacement_while_opening_is_tried_again(
    two, loads, tmp_path: Path, monkeypatch
) -> None:
    """The manifest and index read are A's, the headers would be B's: the open starts over."""
    out = tmp_path / "out"
    shutil.copytree(two["A"], out)
    real, calls = loader.read_header, []

    def read_header(path):
        if not calls:
            _stage(two["B"], out)
        calls.append(path)
        return real(path)

    monkeypatch.setattr(loader, "read_header", read_header)
    art = open_artifact(out)
    assert _which(art.load(ParallelLayout()), loads) == "B"


def test_a_replacement_in_the_middle_of_a_load_is_refused(two, tmp_path: Path, monkeypatch) -> None:
    """One shard opened before the replacement, the others after: refused before any is read."""
    out = tmp_path / "out"
    shutil.copytree(two["A"], out)
    art = open_artifact(out)
    real, opened = _reader._Source.__init__, []

    def source(self, path, stats) -> None:
        real(self, path, stats)
        if not opened:
            _stage(two["B"], out)
        opened.append(path)

    monkeypatch.setattr(_reader._Source, "__init__", source)
    with pytest.raises(Replaced, match="since it was opened"):
        art.load(ParallelLayout())
    assert len(opened) > 1  # the artifact has several shards: a mix was possible


def test_the_ranks_of_a_run_load_the_artifact_their_parent_checked(two, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(two["A"], out)
    checked = open_artifact(out)
    assert open_artifact(out, generation=checked.generation).generation == checked.generation
    _stage(two["B"], out)
    with pytest.raises(Replaced, match="replaced since the run checked it"):
        open_artifact(out, generation=checked.generation)


def test_the_cpu_expert_pool_of_a_replaced_artifact_is_refused(
    tiny_hybrid: Path, tmp_path: Path
) -> None:
    out, other = tmp_path / "out", tmp_path / "other"
    shutil.copytree(tiny_hybrid, out)
    shutil.copytree(tiny_hybrid, other)  # the same files, another artifact (new inodes)
    art = open_artifact(out)
    _stage(other, out)
    with pytest.raises(Replaced):
        art.cpu_expert_pool()
    open_artifact(out).cpu_expert_pool().close()


SWAPPER = """
import sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]).parents[1])]  # this folder, tests/
from test_pin import _stage
out, a, b, n = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
for i in range(n):
    _stage(b if i % 2 == 0 else a, out)
"""


def test_loads_while_another_process_keeps_replacing_the_artifact(
    two, loads, tmp_path: Path
) -> None:
    """Bounded: ``SWAPS`` replacements, at most ``MAX_LOADS`` loads meanwhile; each load is A
    or B whole, or a HetquantError — never a mix."""
    out = tmp_path / "out"
    shutil.copytree(two["A"], out)
    here = Path(__file__).parent
    args = [sys.executable, "-c", SWAPPER, str(here), str(out), str(two["A"]), str(two["B"])]
    swapper = subprocess.Popen([*args, str(SWAPS)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    seen: dict[str, int] = {"A": 0, "B": 0, "mixed": 0, "error": 0}
    try:
        for _ in range(MAX_LOADS):
            if swapper.poll() is not None:
                break
            try:
                seen[_which(_load(out), loads)] += 1
            except HetquantError:
                seen["error"] += 1
    finally:
        _, err = swapper.communicate(timeout=HANG_GUARD)
    assert swapper.returncode == 0, err
    assert seen["mixed"] == 0, seen
    assert _which(_load(out), loads) == "A"  # an even number of swaps: A again, whole
    assert not os.path.exists(out / PARTIAL) or not any((out / PARTIAL).iterdir())
