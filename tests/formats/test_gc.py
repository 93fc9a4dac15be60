"""``formats/_gc.py``: the cycle collector paused while sources open and plans are made, and the
graph a ``hetquant convert`` holds kept out of its passes until the command ends — each leaving
the collector as it found it, for a caller that converts in its own process."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import run_cli

from hetquant.convert import SourceCheckpoint, plan_for
from hetquant.convert.recipes import get_recipe
from hetquant.formats import HetquantError
from hetquant.formats._gc import frozen, paused_gc


@pytest.fixture
def collector_on() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was_on else gc.disable()


def test_paused_gc_is_off_inside_and_restored_after(collector_on) -> None:
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: the inner one leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_paused_gc_restores_after_an_error_and_keeps_a_callers_off(collector_on) -> None:
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("bad input")
    assert gc.isenabled()
    gc.disable()  # the caller turned it off: it stays off
    with paused_gc():
        pass
    assert not gc.isenabled()


def _collected(obj: object) -> bool:
    """Whether ``obj`` is in a generation the collector passes over (not the permanent one)."""
    return any(o is obj for o in gc.get_objects())


def test_frozen_holds_what_exists_and_undoes_only_its_own() -> None:
    assert gc.get_freeze_count() == 0
    before = [1, 2]  # a tracked container
    with frozen():
        made_inside = [3, 4]
        assert not _collected(before) and _collected(made_inside)
    assert _collected(before) and gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own freeze: not undone by the block
    try:
        with frozen():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_opening_and_planning_leave_the_collector_on(collector_on, tiny_ro: Path, tmp_path) -> None:
    src = SourceCheckpoint.open(tiny_ro)
    assert gc.isenabled()
    plan_for(src, get_recipe("bf16"), 1 << 20)
    assert gc.isenabled()
    with pytest.raises(HetquantError, match="not a directory"):
        SourceCheckpoint.open(tmp_path / "missing")
    assert gc.isenabled()  # refused inside the paused block


def test_convert_command_runs_frozen_and_unfreezes_when_it_ends(
    tiny_ro: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion runs with the planned graph frozen; in-process (as the tests and any caller
    run it) nothing stays frozen after the command, whether it converted, only planned, or
    failed after planning."""
    import hetquant.convert.engine.convert as engine

    seen, run = [], engine.convert
    monkeypatch.setattr(engine, "convert", lambda *a, **k: seen.append(gc.get_freeze_count()) or run(*a, **k))  # fmt: skip
    for extra in ([], ["--dry-run"]):
        res = run_cli("convert", tiny_ro, tmp_path / f"out{len(extra)}", "--recipe", "bf16", *extra)
        assert res.exit_code == 0, res.stderr
        assert gc.get_freeze_count() == 0
    assert len(seen) == 1 and seen[0] > 1000  # the dry run converts nothing
    res = run_cli("convert", tiny_ro, tmp_path / "out0", "--recipe", "bf16")  # already complete
    assert res.exit_code == 0 and gc.get_freeze_count() == 0
    (tmp_path / "a-file").write_text("x")  # refused once planned: OUTPUT is no directory
    res = run_cli("convert", tiny_ro, tmp_path / "a-file", "--recipe", "bf16")
    assert res.exit_code == 2 and res.stderr.startswith("error:"), res.stderr
    assert gc.get_freeze_count() == 0
