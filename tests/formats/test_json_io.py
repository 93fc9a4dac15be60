"""``formats/json_io.py``: the one bounded JSON reader — size and nesting capped, every failure a
HetquantError naming the file (issue 25 §2: deeply nested JSON was a RecursionError traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import HetquantError
from hetquant.formats.json_io import MAX_DEPTH, _depth, load_json, parse_json


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_reads_json(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"a": [1, {"b": null}]}')
    assert load_json(tmp_path / "a.json") == {"a": [1, {"b": None}]}
    assert parse_json(b"null", "x") is None


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 100_000])
def test_refuses_nesting_past_the_cap(tmp_path: Path, depth: int) -> None:
    """Under Python's recursion limit (900) the cap refuses it; past it, RecursionError does."""
    path = tmp_path / "deep.json"
    path.write_text('{"x": ' + _nested(depth) + "}")
    with pytest.raises(HetquantError, match=rf"deep\.json: JSON nested more than {MAX_DEPTH}"):
        load_json(path)


def test_accepts_nesting_up_to_the_cap() -> None:
    assert parse_json(_nested(MAX_DEPTH), "x") is not None


def test_refuses_files_over_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text('{"a": "' + "x" * 100 + '"}')
    with pytest.raises(HetquantError, match=r"big\.json: 109 bytes, more than the 50"):
        load_json(path, limit=50)


@pytest.mark.parametrize("raw", [b"{", b"\xff{}", b"", b"{'a': 1}"])
def test_invalid_json_names_the_file(raw: bytes) -> None:
    with pytest.raises(HetquantError, match=r"^f\.json: invalid JSON"):
        parse_json(raw, "f.json")


def test_a_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(HetquantError, match=r"nope\.json: not found"):
        load_json(tmp_path / "nope.json")


def _tree_depth(doc: object) -> int:
    """The reference: levels of nested lists and dicts, walked (a scalar: 0)."""
    if isinstance(doc, dict):
        return 1 + max(map(_tree_depth, doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max(map(_tree_depth, doc), default=0)
    return 0


_TEXT = st.text(
    alphabet=st.sampled_from('[]{}"\\\\/ ,:ab\u00e9\u2028\U0001f600\n\t\x00'), max_size=12
)
_DOCS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_TEXT, kids, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(doc=_DOCS, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_depth_on_the_text_is_the_tree_depth(doc: object, ascii_only: bool, indent: int | None) -> None:  # fmt: skip
    """Brackets, quotes and backslashes inside strings (escaped or not, any UTF-8) never count;
    bytes and str give the same; a document is refused exactly when its tree is too deep."""
    text = json.dumps(doc, ensure_ascii=ascii_only, indent=indent)
    assert _depth(text) == _depth(text.encode()) == _tree_depth(doc)
    wrapped = "[" * (MAX_DEPTH - _tree_depth(doc)) + text + "]" * (MAX_DEPTH - _tree_depth(doc))
    assert parse_json(wrapped.encode(), "x") is not None  # exactly MAX_DEPTH levels (or fewer)
    with pytest.raises(HetquantError, match="nested more than"):
        parse_json("[" + wrapped + "]", "x")
