"""Untrusted tokenizers (issue #25 §3): a tokenizer.json the library cannot read, an
``eos_token_id`` that is no token, a pre-tokenizer regex that backtracks catastrophically — each a
one-line HetquantError from ``load_tokenizer`` / ``token_blocks``, and through ``convert
--calib-data`` and ``eval`` exit 2 with one ``error:`` line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from calib_consts import TINY

from hetquant.calib import encoding
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.formats import HetquantError

HELD = TINY.parents[1] / "examples" / "tiny-tools" / "heldout.txt"
NESTED = "(a+)+$"  # exponential backtracking on a run of a's not followed by the end


def _model(tmp_path: Path, regex: str | None = None, **config: object) -> Path:
    """A copy of the tiny model; ``regex`` replaces its pre-tokenizer's Split pattern."""
    root = tmp_path / "model"
    shutil.copytree(TINY, root)
    if regex is not None:
        tok = json.loads((root / "tokenizer.json").read_text())
        tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex
        (root / "tokenizer.json").write_text(json.dumps(tok))
    if config:
        raw = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps({**raw, **config}))
    return root


@pytest.mark.parametrize(
    "content", ["not json", "{}", '{"model": 3}', json.dumps({"version": "1.0", "model": {}})]
)
def test_unreadable_tokenizer_json(tmp_path: Path, content: str) -> None:
    root = _model(tmp_path)
    (root / "tokenizer.json").write_text(content)
    with pytest.raises(
        HetquantError, match=r"tokenizer\.json: not a tokenizer the tokenizers"
    ) as e:
        load_tokenizer(root)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("eos", ["abc", -1, 640, 10**12, 1.0, True, ["abc"], {"id": 1}])
def test_eos_token_id_must_be_a_token(tmp_path: Path, eos: object) -> None:
    with pytest.raises(HetquantError, match=r"config\.json: field eos_token_id must be an integer in \[0, 639\]"):  # fmt: skip
        load_tokenizer(_model(tmp_path, eos_token_id=eos))


def test_eos_token_id_list_takes_the_first(tmp_path: Path) -> None:
    assert load_tokenizer(_model(tmp_path, eos_token_id=[1, 0]))[1] == 1


def test_backtracking_regex_is_one_line(tmp_path: Path) -> None:
    tok, eos = load_tokenizer(_model(tmp_path, NESTED))
    text = tmp_path / "a.txt"
    text.write_text("a" * 64 + "!")  # onig gives up this match: the library panics
    with pytest.raises(HetquantError, match=r"tokenizer\.json: the tokenizer failed .*retry-limit") as e:  # fmt: skip
        token_blocks([text], tok, eos, 1, 8)
    assert "\n" not in str(e.value)


def test_slow_regex_meets_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # each run of 21 a's stays under onig's retry limit but costs ~0.1-0.5 s: a long document
    # would take hours; the child is killed at the deadline
    tok, eos = load_tokenizer(_model(tmp_path, NESTED))
    text = tmp_path / "a.txt"
    text.write_text(("a" * 21 + "!") * 200)
    monkeypatch.setattr(encoding, "BASE_S", 1.0)
    with pytest.raises(HetquantError, match=r"4,400-byte document took over 1 s"):
        token_blocks([text], tok, eos, 1, 8)


def test_the_child_encodes_as_the_library_does(tmp_path: Path) -> None:
    tok, _ = load_tokenizer(TINY)
    docs = [HELD.read_text()[:5000], "", "ünïcödé 123456 \u200b 🤖"]
    with encoding.BoundedEncoder(tok) as encode:
        assert [encode(d) for d in docs] == [tok.encode(d).ids for d in docs]


def test_convert_calib_data_and_eval_refuse_it(cli, tmp_path: Path, tiny_artifact: Path) -> None:
    model = _model(tmp_path, NESTED)
    text = tmp_path / "a.txt"
    text.write_text("a" * 64 + "!")
    out = tmp_path / "out"
    runs = [
        ("convert", model, out, "--recipe", "awq-w4a16", "--calib-data", text,
         "--calib-samples", 1, "--calib-seq-len", 8),
        ("eval", tiny_artifact, "--reference", model, "--text", text, "--samples", 1,
         "--seq-len", 8),
    ]  # fmt: skip
    for args in runs:
        res = cli(*args)
        assert res.exception is None and res.exit_code == 2, (args[0], res.stderr)
        lines = [x for x in res.stderr.splitlines() if not x.startswith("INFO")]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert "tokenizer.json: the tokenizer failed" in lines[0], lines[0]
        assert "Traceback" not in res.stderr and "panicked" not in res.stderr
    assert not (out / "hetquant.json").exists()
    bad_eos = _model(tmp_path / "eos", eos_token_id="abc")
    res = cli("convert", bad_eos, out, "--recipe", "awq-w4a16", "--calib-data", text)
    assert res.exit_code == 2 and res.exception is None, res.stderr
    assert res.stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in res.stderr
    assert "field eos_token_id must be an integer in [0, 639], got 'abc'" in res.stderr
