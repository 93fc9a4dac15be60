"""A rank's side of ``hetquant run`` (``runtime/serving/run_rank.py``): the layout each rank loads,
the npu ops it is given, the KV-cache check, the reference forward in the spec's dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig
from hetquant.runtime.forward.model import DeepseekV3Reference, DenseWeights
from hetquant.runtime.kernels import npu_emulation
from hetquant.runtime.parallel.layout import ParallelLayout
from hetquant.runtime.serving.run import RunSpec
from hetquant.runtime.serving.run_rank import _check_kv_cache, _layout, _npu_ops, _reference

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(json.loads((TINY / "config.json").read_text()))


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "rank", "want"),
    [
        (1, 1, 1, 0, ParallelLayout()),
        (2, 2, 1, 3, ParallelLayout(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)),
        (1, 3, 1, 2, ParallelLayout(pp_size=3, pp_rank=2)),
        (1, 1, 4, 2, ParallelLayout(ep_size=4, ep_rank=2)),
        (
            2,
            2,
            2,
            2,
            ParallelLayout(tp_size=2, tp_rank=0, pp_size=2, pp_rank=1, ep_size=2, ep_rank=0),
        ),
    ],
)
def test_layout_of_a_rank(tp: int, pp: int, ep: int, rank: int, want: ParallelLayout) -> None:
    assert _layout(RunSpec("a", (0,), tp=tp, pp=pp, ep=ep), rank) == want


def test_npu_ops_emulated_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETQUANT_NPU_EMULATION", raising=False)
    assert _npu_ops("cpu") is None and _npu_ops("npu") is None  # the real torch_npu
    monkeypatch.setenv("HETQUANT_NPU_EMULATION", "1")
    assert _npu_ops("npu") is npu_emulation and _npu_ops("cpu") is None


def test_kv_cache_check(cfg: ModelConfig) -> None:
    _check_kv_cache(RunSpec("a", (0,)), cfg)
    with pytest.raises(HetquantError, match="--kv-cache 'fp4': give one of fp8_ds_mla"):
        _check_kv_cache(RunSpec("a", (0,), kv_cache="fp4"), cfg)
    with pytest.raises(HetquantError, match="emulates no KV cache; leave it out"):
        _check_kv_cache(RunSpec("a", (0,), kv_cache="fp8_ds_mla"), cfg)


@pytest.mark.parametrize(
    ("device", "dtype", "want"),
    [
        ("cpu", None, torch.float32),
        ("cpu", "bfloat16", torch.bfloat16),
        ("npu", None, torch.bfloat16),
    ],
)
def test_reference_in_the_spec_dtype(
    cfg: ModelConfig, device: str, dtype: str | None, want: torch.dtype
) -> None:
    model = _reference(
        cfg, DenseWeights({}, cfg.family), RunSpec("a", (0,), device=device, dtype=dtype)
    )
    assert type(model) is DeepseekV3Reference and model.dtype == want
