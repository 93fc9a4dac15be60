"""Calibration and eval's streamed forward on DeepSeek-V4 (``examples/tiny-deepseek-v4``).

V4's layers are not composed by ``LayerRunner`` (hyper-connections, per-sequence compressors):
it runs the reference forward's own layer per sequence, so the streamed forward equals the
reference bit for bit. DeepSeek-V4 has no attention balances (``_NO_AWQ`` in its family); AWQ
searches its MLPs — every routed expert's and the shared expert's up → down balance and clips —
on inputs that carry the SwiGLU clip (``swiglu_limit``), which the objective applies too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetquant.calib import AwqOptions, calibrate
from hetquant.calib.eval import evaluate, forward_from_calibration, reference_forward_from_source
from hetquant.calib.forward import Capture, LayerRunner, LayerWeights
from hetquant.convert import SourceCheckpoint
from hetquant.runtime.forward.deepseek_v4 import DeepseekV4Reference
from hetquant.runtime.forward.model import DenseWeights

T = 132  # > the HCA rate (128)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 640, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", ["deepseek", "transformers"])
def test_streamed_forward_is_the_reference_bit_for_bit(layout: str, tiny_v4: dict) -> None:
    src = SourceCheckpoint.open(tiny_v4[layout])
    tokens = _tokens(2)
    streamed = reference_forward_from_source(src, device="cpu")(tokens)
    state = {n: src.dequantized(n) for n in src.tensors}
    state = {n: t.float() if t.is_floating_point() else t for n, t in state.items()}
    model = DeepseekV4Reference(src.config, DenseWeights(state, src.config.family))
    assert torch.equal(streamed, torch.stack([model.forward(row) for row in tokens]))


def test_capture_keeps_every_sequence_s_routing(tiny_v4: dict) -> None:
    """One capture over a per-sequence layer: the MoE input and routing of all N sequences."""
    src = SourceCheckpoint.open(tiny_v4["deepseek"])
    cfg, fam = src.config, src.config.family
    runner = LayerRunner(cfg, T, torch.device("cpu"), torch.float32)
    tokens = _tokens(3, seed=1)
    h = runner.embed(src.dequantized(fam.tensor("embed")), tokens)  # [N, T, n, D]
    assert h.shape == (3, T, cfg.hc_mult, cfg.hidden_size)
    state = {n: src.dequantized(n) for n in src.tensors if n.startswith(fam.prefix(0))}
    cap = Capture()
    runner.run(0, h, LayerWeights(state, cap, family=fam), tokens)
    table = state[fam.tensor("hash_table", 0)].long()
    assert cap.moe_input is not None and cap.moe_input.shape == (3 * T, cfg.hidden_size)
    assert torch.equal(cap.topk_ids, table[tokens.reshape(-1)])  # layer 0 routes by hash


def test_awq_calibration_runs_and_stays_near_the_source(tiny_v4: dict) -> None:
    src = SourceCheckpoint.open(tiny_v4["deepseek"])
    tokens = _tokens(2, seed=2)
    result = calibrate(src, tokens, AwqOptions(group_size=64), device="cpu")
    experts = [n for n in result.quantized if ".experts." in n]
    assert experts and all(".mtp." not in n and not n.startswith("mtp.") for n in result.quantized)
    assert any(".experts." in n for n in result.transforms)  # searched scales / clips
    for st in result.stats["layers"]:
        assert 0 < st["rel_err"] < 1
        assert sum(st["expert_tokens"]) >= tokens.numel()  # every sequence's routing kept
    held = _tokens(2, seed=3)
    res = evaluate(forward_from_calibration(src, result, device="cpu"),
                   reference_forward_from_source(src, device="cpu"), held)  # fmt: skip
    # random weights predict nearly uniformly (ppl ≈ vocab 640), so top-1 means little here;
    # measured: KL 0.063, ppl 746.6 against the source's 730.6 (4-bit, group 64)
    assert 0 < res["kl"] < 0.5 and abs(res["ppl"] / res["ref_ppl"] - 1) < 0.1, res


def test_layer_runner_reads_the_clip(tiny_v4: dict, tmp_path: Path) -> None:
    src = SourceCheckpoint.open(tiny_v4["deepseek"])
    runner = LayerRunner(src.config, T, torch.device("cpu"), torch.float32)
    assert runner.limit == 10.0 and not runner.composable
