"""``hetquant convert`` builds its plan once: the CLI's plan (made for --dry-run and the
calibration check) is the one the engine executes; a plan of another recipe or shard size is
refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import TINY, run_cli

from hetquant.convert import SourceCheckpoint, convert, get_recipe, plan_for
from hetquant.convert.engine import convert as engine
from hetquant.convert.planning import plan as planning


def test_cli_plans_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = []

    def counting(*args, **kwargs):
        built.append(args[1].name)
        return plan_for(*args, **kwargs)

    monkeypatch.setattr(planning, "plan_for", counting)  # what the CLI imports at call time
    monkeypatch.setattr(engine, "plan_for", counting)
    res = run_cli("convert", TINY, tmp_path / "out", "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    assert built == ["bf16"]


def test_a_plan_of_another_recipe_or_size_is_refused(tmp_path: Path) -> None:
    src = SourceCheckpoint.open(TINY)
    plan = plan_for(src, get_recipe("bf16"), 1 << 20)
    with pytest.raises(ValueError, match="recipe bf16"):
        convert(src, tmp_path / "a", get_recipe("ascend-w8a8"), max_shard_size=1 << 20, plan=plan)
    with pytest.raises(ValueError, match="shards of"):
        convert(src, tmp_path / "b", get_recipe("bf16"), max_shard_size=2 << 20, plan=plan)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
