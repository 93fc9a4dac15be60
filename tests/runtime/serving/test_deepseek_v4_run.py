"""DeepSeek-V4 through ``hetquant run`` / ``eval``: the hybrid artifact (W8A8 attention on the NPU
part, the routed experts' FP4 codes and scales kept losslessly in ``cpu_experts/``, computed by
the CPU pool's exact int8 path) single rank, TP2 and with two subpools; eval's perplexity of the
bf16 and hybrid artifacts against the FP8 + FP4 source.

Bounds. Subpools split along the intermediate quantize each half's activations on their own;
TP2 quantizes each rank's slice of a row-parallel W8A8 input with its own per-token scale (as
``test_run.py`` argues for DeepSeek-V3): perturbations of ~1% of the logit range. V4 then makes
discrete choices on perturbed values — the indexer keeps 4 of up to 35 compressed entries, the
router 2 of 8 experts — and a flipped pick moves that position's and later positions' logits by
O(1). So the bounds are on the typical position and on the top-1 token, with the measured values
(this model, T = 140): median per-position max |Δ| / max|logit| — subpools 0 (each half's
activations quantize as the whole's here), TP2 0.034, hybrid vs bf16 0.095; top-1 agreement 1,
0.83, 0.68. (Drawn by ``torch.randn`` before the generator moved to ``tiny-tools/draw.py``'s
ISA-independent draws, the same model measured TP2 0.029 / 0.90 and hybrid 0.058 / 0.79: how
often a pick flips depends on the draw, so the bounds keep a margin under each.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats.fp4_cpu import fp4_gemv_int8
from hetquant.runtime import open_artifact
from hetquant.runtime.forward.moe import swiglu
from hetquant.runtime.serving.run import RunSpec, local_model, run_artifact

T = 140  # > the HCA rate (128): every attention path contributes
TOKENS = tuple(torch.randint(0, 640, (T,), generator=torch.Generator().manual_seed(3)).tolist())
TEXT = Path(__file__).resolve().parents[3] / "examples" / "tiny-tools" / "heldout.txt"


@pytest.fixture(scope="module")
def arts(tiny_v4: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("v4-hybrid")
    src = SourceCheckpoint.open(tiny_v4["deepseek"])
    out = {r: base / r for r in ("bf16", "ascend-hybrid")}
    for recipe, path in out.items():
        convert(src, path, get_recipe(recipe), max_shard_size=1 << 40)
    return out


def test_hybrid_with_lossless_fp4_experts_runs(arts: dict[str, Path]) -> None:
    bf16 = local_model(arts["bf16"]).forward(torch.tensor(TOKENS)).numpy()
    one = local_model(arts["ascend-hybrid"]).forward(torch.tensor(TOKENS)).numpy()
    tp2, _ = run_artifact(RunSpec(str(arts["ascend-hybrid"]), TOKENS, tp=2))
    tp2_sp2, gen = run_artifact(
        RunSpec(str(arts["ascend-hybrid"]), TOKENS, tp=2, subpools=2, generate=2)
    )
    scale = float(np.abs(one).max())
    for a, b, median, top1 in ((tp2_sp2, tp2, 0.05, 0.85), (tp2, one, 0.05, 0.75),
                               (one, bf16, 0.15, 0.6)):  # fmt: skip
        rows = np.abs(a - b).max(-1)  # [T]
        assert float(np.median(rows)) <= median * scale
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= top1
    assert float(np.abs(one - bf16).max()) > 0  # the hybrid is not the bf16 model
    assert len(gen) == 2


def test_pool_applies_the_swiglu_clip_exactly(arts: dict[str, Path]) -> None:
    """The CPU pool's FP4 experts with V4's clip equal the int8 reference with the clip, bit for
    bit (one subpool); a limit that bites changes the result."""
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 6], [6, 6], [0, 3], [3, 1], [7, 2]])  # a token may repeat an expert
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    layer, limit = 2, 0.05
    with open_artifact(arts["ascend-hybrid"]).cpu_expert_pool(subpools=1) as pool:
        got = pool.forward(layer, x, ids, w, limit)
        plain = pool.forward(layer, x, ids, w)
        t = pool.subpool_tensors(0, layer)  # views of the mapped file: used before it closes
        want = torch.zeros_like(x)
        for tok in range(5):
            for slot in range(2):
                e = int(ids[tok, slot])
                gu = fp4_gemv_int8(t["gate_up_packed"][e], t["gate_up_scale"][e], x[tok : tok + 1])
                act = swiglu(gu[:, 0::2], gu[:, 1::2], limit)
                y = fp4_gemv_int8(t["down_packed"][e], t["down_scale"][e], act)
                want[tok] += y[0] * w[tok, slot]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert float((got - plain).abs().max()) > 1e-3


@pytest.mark.parametrize(("recipe", "max_kl", "min_top1"), [("bf16", 1e-6, 1.0),
                                                             ("ascend-hybrid", 0.5, 0.5)])  # fmt: skip
def test_eval_perplexity(
    recipe: str,
    max_kl: float,
    min_top1: float,
    arts: dict[str, Path],
    tiny_v4: dict,
    cli,
    tmp_path: Path,
) -> None:  # type: ignore[no-untyped-def]
    """``hetquant eval`` against the FP8 + FP4 source (its streamed reference forward): the bf16
    artifact is the source's exact dequantization — the same perplexity —, the hybrid near it."""
    out = tmp_path / "eval.json"
    res = cli("eval", arts[recipe], "--reference", tiny_v4["deepseek"], "--text", TEXT,
              "--samples", "2", "--seq-len", str(T), "--json", out,
              "--max-kl", str(max_kl), "--min-top1", str(min_top1))  # fmt: skip
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    assert doc["kl"] >= 0 and 1 < doc["ref_ppl"] < 640 * 4
    if recipe == "bf16":
        assert abs(doc["ppl"] - doc["ref_ppl"]) <= 1e-4 * doc["ref_ppl"]
