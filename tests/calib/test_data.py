"""Calibration text → token blocks: the documented rule, determinism, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from calib_consts import TINY

from hetquant.calib.data import documents, load_tokenizer, token_blocks, tokens_digest
from hetquant.formats import HetquantError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


def test_rule_concatenate_with_eos_and_cut_blocks(tok, tmp_path):
    tokenizer, eos = tok
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_text("The def statement defines a function.")
    docs_b = ["Lists are mutable sequences.", "", "Tuples are not."]
    b.write_text("\n".join(json.dumps({"text": d}) if d else "" for d in docs_b) + "\n")
    # rule: a is one document, b one per non-empty line; each encoded (BOS prepended by the
    # tokenizer) and followed by EOS; the empty line is skipped
    stream = []
    for d in ["The def statement defines a function.", docs_b[0], docs_b[2]]:
        stream += [*tokenizer.encode(d).ids, eos]
    assert stream[0] == 0  # BOS of the tiny tokenizer, as DeepSeek's prepends it
    n = len(stream) // 8
    got = token_blocks([a, b], tokenizer, eos, n_samples=n, seq_len=8)
    assert got.dtype == torch.long and got.shape == (n, 8)
    assert got.reshape(-1).tolist() == stream[: n * 8]  # consecutive blocks, tail dropped
    again = token_blocks([a, b], tokenizer, eos, n_samples=n, seq_len=8)
    assert torch.equal(got, again) and tokens_digest(got) == tokens_digest(again)


def test_file_order_is_sample_order(tok, text_files):
    tokenizer, eos = tok
    ab = token_blocks(list(text_files), tokenizer, eos, 2, 32)
    ba = token_blocks(list(reversed(text_files)), tokenizer, eos, 2, 32)
    assert not torch.equal(ab, ba)
    assert torch.equal(ab[0], token_blocks([text_files[0]], tokenizer, eos, 1, 32)[0])


def test_too_little_text_names_the_shortfall(tok, tmp_path):
    tokenizer, eos = tok
    f = tmp_path / "short.txt"
    f.write_text("tiny")
    with pytest.raises(HetquantError, match=r"has \d+ tokens; 4 samples × 16 tokens need 64"):
        token_blocks([f], tokenizer, eos, 4, 16)


def test_bad_jsonl_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(HetquantError, match=r"bad.jsonl:2: expected an object"):
        list(documents([f]))
