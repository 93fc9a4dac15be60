"""convert/__init__.py is a lazy face: every name it lists resolves to its room's object, and
importing it (or a light room) loads neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hetquant.convert as face
from hetquant.convert.engine import convert as engine_convert
from hetquant.convert.planning import source


def test_every_listed_name_resolves_to_its_room() -> None:
    for name in face.__all__:
        assert getattr(face, name) is not None, name
    assert face.convert is engine_convert.convert
    assert face.SourceCheckpoint is source.SourceCheckpoint
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = face.nope


@pytest.mark.parametrize(
    "statement",
    [
        "import hetquant.convert",
        "from hetquant.convert import get_recipe, RECIPES",
        "from hetquant.convert.export.plan import replay_export",
    ],
)
def test_light_imports_load_no_torch_and_no_engine(statement: str) -> None:
    code = (
        f"import sys; {statement}; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('hetquant.convert.engine.convert')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
