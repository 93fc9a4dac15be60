"""What every family's reference forward shares (``runtime/forward/decoder.py``): RMSNorm by hand
and in its working dtype, the refusals (a family it cannot run, bad token ids), positions."""

from __future__ import annotations

import copy
import json
import runpy
from pathlib import Path

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig
from hetquant.runtime.forward.decoder import check_runnable, rms_norm
from hetquant.runtime.forward.model import DeepseekV3Reference, DenseWeights

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(json.loads((TINY / "config.json").read_text()))


def test_rms_norm_by_hand() -> None:
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])  # mean(x²) = 12.5, then 0
    w = torch.tensor([1.0, 2.0])
    got = rms_norm(x, w, 0.5)  # 1 / sqrt(13) and 1 / sqrt(0.5)
    want = torch.tensor([[3.0, 8.0], [0.0, 0.0]]) / torch.tensor(13.0).sqrt()
    torch.testing.assert_close(got[:1], want[:1], rtol=2**-22, atol=0)
    assert torch.equal(got[1], torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rms_norm_works_in_float32_or_float64_and_returns_x_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 16, generator=g).to(dtype), torch.randn(16, generator=g)
    wd = torch.float64 if dtype == torch.float64 else torch.float32
    xw = x.to(wd)
    want = (w.to(wd) * (xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + 1e-6))).to(dtype)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)


def test_check_runnable_refuses_a_family_it_cannot_run(cfg: ModelConfig) -> None:
    check_runnable(cfg)
    gen = runpy.run_path(str(REPO / "examples" / "deepseek-v32" / "make_tiny.py"))
    v32 = ModelConfig.from_dict(copy.deepcopy(gen["CONFIG"]))
    with pytest.raises(HetquantError, match="model_type 'deepseek_v32'"):
        check_runnable(v32)
    with pytest.raises(HetquantError, match="model_type 'deepseek_v32'"):
        DeepseekV3Reference(v32, DenseWeights({}, v32.family))


def test_forward_refuses_bad_tokens_before_reading_a_weight(cfg: ModelConfig) -> None:
    model = DeepseekV3Reference(cfg, DenseWeights({}, cfg.family))  # no tensor at all
    for bad in (torch.tensor([[1, 2]]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(HetquantError, match="non-empty 1-D token tensor"):
            model.forward(bad)
    with pytest.raises(HetquantError, match=rf"token ids must lie in \[0, {cfg.vocab_size}\)"):
        model.forward(torch.tensor([0, cfg.vocab_size]))
    with pytest.raises(HetquantError, match="no tensor"):
        model.forward(torch.tensor([0, 1]))  # valid ids: the first weight read is refused


def test_positions_and_hidden_shape(cfg: ModelConfig) -> None:
    model = DeepseekV3Reference(cfg, DenseWeights({}, cfg.family))
    cos, sin, mask = model.positions(torch.zeros(4, cfg.hidden_size))
    assert cos.shape == sin.shape == (4, cfg.qk_rope_head_dim // 2)
    assert torch.equal(cos[0], torch.ones_like(cos[0])) and torch.equal(
        sin[0], torch.zeros_like(sin[0])
    )
    assert torch.equal(mask.isinf(), torch.ones(4, 4, dtype=torch.bool).triu(1))
    assert model.hidden_shape(7) == (7, cfg.hidden_size)
