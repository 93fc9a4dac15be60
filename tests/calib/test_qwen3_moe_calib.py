"""AWQ calibration of the tiny Qwen3-MoE checkpoint: the family's mappings as data.

- The layer runner composes the family's reference forward (``runtime/forward/qwen3_moe.py``): equal to
  ``Qwen3MoeReference.decoder_layer`` per sequence within float32 summation order (the bound of
  test_calibrate.py: ``8 · K_max · u · max|out|``).
- Which balances run: ``attn_in`` (input_layernorm → q/k/v) and ``mlp_in`` (post-attention norm
  → every expert's gate/up, router compensated, or the dense MLP's gate/up) in every layer; v → o
  only without GQA (``Balance.when``).
- Folding the searched scales (powers of two, no clip) leaves every float layer's output
  bit-identical, the router's expert choice included: the folds are exact algebra.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import make_tiny_qwen3

from hetquant.calib import AwqOptions, calibrate
from hetquant.calib.calibrate import apply_transform
from hetquant.calib.forward import Capture, LayerRunner, LayerWeights, layer_names
from hetquant.convert import SourceCheckpoint
from hetquant.runtime.forward.model import DenseWeights
from hetquant.runtime.forward.qwen3_moe import Qwen3MoeReference

U = 2.0**-24
OUTLIERS = slice(None, None, 32)  # every 32nd hidden channel of the embedding ×20: AWQ has work


def _source(root: Path) -> tuple[SourceCheckpoint, dict[str, torch.Tensor]]:
    src = SourceCheckpoint.open(root)
    state = {n: src.dequantized(n).float() for n in src.tensors}
    state["model.embed_tokens.weight"][:, OUTLIERS] *= 20
    return src, state


@pytest.fixture(scope="module")
def sources(tiny_qwen3: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    mha = make_tiny_qwen3().write_checkpoint(
        tmp_path_factory.mktemp("qwen3-mha") / "fp8", "fp8", {"num_key_value_heads": 8}
    )
    return {"gqa": _source(tiny_qwen3["fp8"]), "mha": _source(mha)}


TOKENS = torch.arange(128).reshape(2, 64) * 37 % 640


def _calibrate(src: SourceCheckpoint, state: dict, **opts):  # type: ignore[no-untyped-def]
    options = AwqOptions(group_size=64, min_expert_tokens=8, **opts)
    return calibrate(src, TOKENS, options, device="cpu", weights_fn=state.__getitem__)


def _runs(src: SourceCheckpoint, state: dict):  # type: ignore[no-untyped-def]
    """(runner, [(layer, names, hidden states in)]) of the float model on TOKENS."""
    cfg, fam = src.config, src.config.family
    runner = LayerRunner(cfg, TOKENS.shape[1], torch.device("cpu"), torch.float32)
    h = runner.embed(state["model.embed_tokens.weight"], TOKENS)
    out = []
    for layer in range(cfg.num_hidden_layers):
        names = layer_names(src.tensors, layer, fam)
        out.append((layer, names, h))
        h = runner.run(layer, h, LayerWeights({n: state[n] for n in names}, family=fam))
    return runner, out


def test_layer_composition_is_the_reference_forward(sources) -> None:  # type: ignore[no-untyped-def]
    src, state = sources["gqa"]
    runner, runs = _runs(src, state)
    fam = src.config.family
    for layer, names, h in runs:  # layer 1 is dense (mlp_only_layers), 0 and 2 MoE
        ours = runner.run(layer, h, LayerWeights({n: state[n] for n in names}, family=fam))
        ref = Qwen3MoeReference(src.config, DenseWeights(state, fam))
        theirs = torch.stack(
            [ref.decoder_layer(layer, hn, runner.cos, runner.sin, runner.mask) for hn in h]
        )
        tol = 8 * 512 * U * float(theirs.abs().max())
        assert float((ours - theirs).abs().max()) <= tol, f"layer {layer}"


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_mappings_and_exact_folds(kind: str, sources) -> None:  # type: ignore[no-untyped-def]
    src, state = sources[kind]
    result = _calibrate(src, state, pow2_scales=True, clip=False, propagate="float")
    for stats in result.stats["layers"]:
        labels = set(stats["scales"])
        assert {"attn_in", "mlp_in"} <= labels
        assert ("o" in labels) == (kind == "mha"), labels  # v → o only without GQA
    assert any(
        t.col_mul is not None and not bool((t.col_mul == 1).all())
        for t in result.transforms.values()
    )
    runner, runs = _runs(src, state)
    fam, moe_folds = src.config.family, 0
    for layer, names, h in runs:
        ws = {n: state[n] for n in names}
        folded = {n: apply_transform(ws[n], result.transforms.get(n), None) for n in names}
        cap, cap_f = Capture(), Capture()
        out = runner.run(layer, h, LayerWeights(ws, cap, family=fam))
        out_f = runner.run(layer, h, LayerWeights(folded, cap_f, family=fam))
        assert torch.equal(out_f, out), f"layer {layer}"
        if src.config.is_moe_layer(layer):
            norm = result.transforms.get(fam.tensor("ffn_norm", layer))
            if norm is not None and not bool((norm.row_div == 1).all()):  # the norm absorbed 1/s
                assert not torch.equal(cap.moe_input, cap_f.moe_input)
                moe_folds += 1
            assert torch.equal(cap.topk_ids, cap_f.topk_ids)  # the compensated router agrees
    assert moe_folds > 0
