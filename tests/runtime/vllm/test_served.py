"""Bad input to ``--quantization hetquant`` / ``--load-format hetquant``: one line naming the reason
and the legal values (``runtime/vllm/served.py``; the loader's layout check). No vLLM needed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from support import MANIFEST, TINY

from hetquant.formats import HetquantError
from hetquant.formats.filenames import READABLE_SCHEMAS
from hetquant.runtime import ParallelLayout
from hetquant.runtime.vllm.served import KERNELS_ENV, kernel_choice, open_served


def test_a_checkpoint_that_is_not_an_artifact_is_refused() -> None:
    with pytest.raises(HetquantError, match="is not a hetquant artifact") as e:
        open_served(TINY)
    assert "\n" not in str(e.value) and "hetquant convert" in str(e.value)


def test_another_manifest_schema_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    doc = json.loads((art / MANIFEST).read_text())
    doc["schema_version"] = 99
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(
        HetquantError,
        match=r"--quantization hetquant: .*unknown manifest schema 99; this hetquant reads schemas "
        + re.escape(str(list(READABLE_SCHEMAS))),
    ):
        open_served(art)


def test_a_tp_size_the_artifact_cannot_split_is_refused(tiny_artifact: Path) -> None:
    art = open_served(tiny_artifact)
    with pytest.raises(HetquantError) as e:
        art.plan(ParallelLayout(tp_size=3, tp_rank=0))  # what the loader's load() runs first
    assert "\n" not in str(e.value) and "valid tp sizes: 1, 2, 4" in str(e.value)


def test_the_kernel_choice_is_vllm_unless_told_and_refuses_unknown_values() -> None:
    assert kernel_choice({}) == "vllm"
    assert kernel_choice({KERNELS_ENV: "hetquant"}) == "hetquant"
    with pytest.raises(HetquantError) as e:
        kernel_choice({KERNELS_ENV: "fast"})
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("HETQUANT_VLLM_KERNELS='fast': give one of vllm, hetquant")
