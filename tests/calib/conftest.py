"""Fixtures for the calibration tests: the tiny FP8 model, calibration / held-out text, and
calibrations shared by the tests of a session (each costs seconds on the CPU).

Outliers: the tiny model's weights are i.i.d. random, so its activations have no salient
channels and AWQ's scales have nothing to protect (the search keeps s = 1 and only the clip
helps). ``outlier_fn`` reproduces the situation AWQ is for: 8 of the 256 hidden channels of the
embedding (every 32nd) scaled ×20, so every RMSNorm output carries 8 large channels. The FP8
reference of the comparisons is the same modified model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from calib_consts import (  # tests/calib is on sys.path (rootdir-relative import)
    CALIB,
    HELD_OUT,
    MIN_EXPERT_TOKENS,
    OUTLIER_CHANNELS,
    OUTLIER_GAIN,
    TINY,
    single_thread,
)

from hetquant.calib import AwqOptions, calibrate, load_tokenizer, token_blocks
from hetquant.calib.forward import source_tensor_fn
from hetquant.convert import SourceCheckpoint


@pytest.fixture(scope="session")
def tiny_source() -> SourceCheckpoint:
    return SourceCheckpoint.open(TINY)


@pytest.fixture(scope="session")
def text_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(calibration text, held-out text): disjoint halves of CPython's pydoc topics."""
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    root = tmp_path_factory.mktemp("text")
    calib, held = root / "calib.txt", root / "held.txt"
    calib.write_text("\n\n".join(topics.topics[k] for k in keys[: len(keys) // 2]))
    held.write_text("\n\n".join(topics.topics[k] for k in keys[len(keys) // 2 :]))
    return calib, held


@pytest.fixture(scope="session")
def calib_tokens(text_files) -> torch.Tensor:
    tok, eos = load_tokenizer(TINY)
    return token_blocks([text_files[0]], tok, eos, *CALIB)


@pytest.fixture(scope="session")
def held_tokens(text_files) -> torch.Tensor:
    tok, eos = load_tokenizer(TINY)
    return token_blocks([text_files[1]], tok, eos, *HELD_OUT)


@pytest.fixture(scope="session")
def outlier_fn(tiny_source):
    base = source_tensor_fn(tiny_source)

    def get(name: str) -> torch.Tensor:
        w = base(name)
        if name == "model.embed_tokens.weight":
            w = w.clone()
            w[:, OUTLIER_CHANNELS] *= OUTLIER_GAIN
        return w

    return get


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _calibrate(source, tokens, fn, method: str):
    opts = AwqOptions(method=method, propagate="float", min_expert_tokens=MIN_EXPERT_TOKENS)
    with single_thread():  # session fixtures are set up before the autouse one applies
        return calibrate(source, tokens, opts, device="cpu", weights_fn=fn)


@pytest.fixture(scope="session")
def awq_outliers(tiny_source, calib_tokens, outlier_fn):
    """AWQ on the outlier model; float propagation, so that every layer of this and of
    ``rtn_outliers`` sees the same inputs and their layer errors compare like for like."""
    return _calibrate(tiny_source, calib_tokens, outlier_fn, "awq")


@pytest.fixture(scope="session")
def rtn_outliers(tiny_source, calib_tokens, outlier_fn):
    return _calibrate(tiny_source, calib_tokens, outlier_fn, "rtn")
