"""Evaluation: the metrics' arithmetic, and the forwards built from sources and artifacts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hetquant.calib import AwqOptions, calibrate
from hetquant.calib.eval import (
    ArtifactTensors,
    evaluate,
    forward_from_artifact_dequantized,
    forward_from_calibration,
    per_sequence,
    reference_forward_from_source,
)
from hetquant.convert import SourceCheckpoint
from hetquant.formats import HetquantError
from hetquant.formats.int4_cpu import dequantize_expert, quantize_expert, stack_experts


def test_metrics_on_known_distributions():
    tokens = torch.tensor([[0, 1, 2, 3, 0]])
    uniform = torch.zeros(1, 5, 4)
    peaked = torch.zeros(1, 5, 4)
    peaked[0, :, 1] = math.log(3.0)  # p = (1/6, 1/2, 1/6, 1/6)
    ev = evaluate(lambda t: peaked, lambda t: uniform, tokens)
    assert ev["ref_ppl"] == pytest.approx(4.0)  # uniform over 4
    # targets 1, 2, 3, 0: p = 1/2, 1/6, 1/6, 1/6
    assert ev["ppl"] == pytest.approx(math.exp(-(math.log(0.5) + 3 * math.log(1 / 6)) / 4))
    kl = sum(0.25 * math.log(0.25 / q) for q in (1 / 6, 1 / 2, 1 / 6, 1 / 6))
    assert ev["kl"] == pytest.approx(kl) and ev["positions"] == 4
    assert ev["top1"] == 0.0  # uniform's argmax is 0, peaked's is 1
    same = evaluate(lambda t: peaked, lambda t: peaked, tokens)
    assert same["kl"] == 0.0 and same["top1"] == 1.0 and same["ppl"] == same["ref_ppl"]
    with pytest.raises(HetquantError, match="expected \\[N, T, V\\]"):
        evaluate(lambda t: peaked[0], lambda t: peaked, tokens)
    two = per_sequence(lambda row: peaked[0, : len(row)])(tokens.repeat(2, 1))
    assert two.shape == (2, 5, 4)


def test_bf16_artifact_matches_the_reference(tiny_artifact: Path, tiny_ro: Path, held_tokens):
    ref = reference_forward_from_source(SourceCheckpoint.open(tiny_ro), device="cpu")
    ev = evaluate(forward_from_artifact_dequantized(tiny_artifact, device="cpu"), ref, held_tokens)
    assert ev["kl"] == pytest.approx(0.0, abs=1e-12) and ev["top1"] == 1.0
    assert ev["ppl"] == pytest.approx(ev["ref_ppl"], rel=1e-12)


def test_rtn_calibration_forward_is_the_awq_artifact(cli, tiny_ro: Path, tmp_path, held_tokens):
    """``forward_from_calibration`` (no calibration: identity transforms) reproduces, bit for
    bit, the awq-w4a16 artifact the converter writes today (round-to-nearest)."""
    out = tmp_path / "awq"
    res = cli("convert", tiny_ro, out, "--recipe", "awq-w4a16")
    assert res.exit_code == 0, res.stderr
    src = SourceCheckpoint.open(tiny_ro)
    rtn = calibrate(src, held_tokens[:1, :8], AwqOptions(method="rtn"), device="cpu")
    assert not rtn.transforms and len(rtn.quantized) > 0
    ours = forward_from_calibration(src, rtn, device="cpu")(held_tokens)
    theirs = forward_from_artifact_dequantized(out, device="cpu")(held_tokens)
    assert torch.equal(ours, theirs)


def test_hybrid_artifact_reads_cpu_experts(cli, tiny_ro: Path, tmp_path, held_tokens):
    out = tmp_path / "hybrid"
    res = cli("convert", tiny_ro, out, "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    tensors = ArtifactTensors(out)
    src = SourceCheckpoint.open(tiny_ro)
    fp8 = src.config.weight_block_size
    assert fp8 is not None
    from hetquant.calib.forward import source_tensor_fn

    fn = source_tensor_fn(src)
    p = "model.layers.2.mlp.experts.5"
    gate, up, down = (fn(f"{p}.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
    want = dequantize_expert(stack_experts([quantize_expert(gate, up, down)]), 0)
    got = [tensors(f"{p}.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj")]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ref = reference_forward_from_source(src, device="cpu")
    ev = evaluate(forward_from_artifact_dequantized(out, device="cpu"), ref, held_tokens)
    assert 0 < ev["kl"] < 0.1 and ev["top1"] > 0.5, ev
