"""The text path of a Qwen3-VL-MoE artifact against transformers'
``Qwen3VLMoeForConditionalGeneration`` on text-only input (mrope positions for text: the three
position rows equal), single rank and TP2; ``hetquant eval`` on the text path.

Tolerance as ``test_qwen3_moe_forward.py`` argues it: float32 on both sides, summation order
only — ``(4 + 8 · layers) · K_max · u · max|logit|`` for a sharded run (u = 2^-24).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetquant.convert import SourceCheckpoint, convert
from hetquant.convert.recipes import get_recipe
from hetquant.formats.families.vlm import VlmFamily
from hetquant.runtime.forward.qwen3_moe import Qwen3MoeReference
from hetquant.runtime.forward.references import reference_for
from hetquant.runtime.serving.run import RunSpec, local_model, run_artifact

transformers = pytest.importorskip("transformers")  # the comparison's other side

U = 2.0**-24
TOKENS = (5, 17, 42, 100, 7, 300, 250, 11, 639, 0, 64, 128)
TEXT_DIR = Path(__file__).resolve().parents[3] / "examples" / "tiny-tools"


@pytest.fixture(scope="module")
def bf16_artifact(tiny_qwen3_vl: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-vl-run") / "bf16"
    convert(SourceCheckpoint.open(tiny_qwen3_vl["bf16"]), out, get_recipe("bf16"),
            max_shard_size=1 << 20)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_vl: dict[str, Path]):  # type: ignore[no-untyped-def]
    """transformers' model read from the released-layout BF16 source (its own loader transposes
    the fused experts), float32, eager attention."""
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_vl["bf16"], dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _hf_logits(model, tokens: tuple[int, ...]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].to(torch.float32)


def test_forward_is_the_text_family_s(bf16_artifact: Path) -> None:
    model = local_model(bf16_artifact)
    assert isinstance(model.cfg.family, VlmFamily) and isinstance(model, Qwen3MoeReference)
    assert reference_for(model.cfg) is Qwen3MoeReference


@pytest.mark.parametrize("tp", [1, 2])
def test_run_matches_transformers(tp: int, bf16_artifact: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    logits, _ = run_artifact(RunSpec(str(bf16_artifact), TOKENS, tp=tp))
    theirs = _hf_logits(hf_model, TOKENS)
    text = hf_model.config.text_config
    k_max = max(text.hidden_size, text.intermediate_size, text.moe_intermediate_size,
                text.num_attention_heads * text.head_dim)  # fmt: skip
    tol = (4 + 8 * text.num_hidden_layers) * k_max * U * float(theirs.abs().max())
    diff = float((torch.from_numpy(logits) - theirs).abs().max())
    assert diff <= tol, f"tp={tp}: max |Δlogit| {diff:.3g} > {tol:.3g}"
    assert float(theirs.std()) > 0.1


def test_greedy_matches_transformers(bf16_artifact: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompt = torch.tensor(TOKENS[:6])
    ours = local_model(bf16_artifact).generate(prompt, 6)
    with torch.no_grad():
        theirs = hf_model.generate(prompt[None], max_new_tokens=6, do_sample=False)[0]
    assert torch.equal(ours[: theirs.numel()], theirs)


def test_eval_on_the_text_path(cli, tiny_qwen3_vl: dict[str, Path], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``hetquant eval`` of a W8A8 artifact against its FP8 source: runs, near the reference."""
    out = tmp_path / "w8a8"
    assert cli("convert", tiny_qwen3_vl["fp8"], out, "--recipe", "ascend-w8a8").exit_code == 0
    res = cli("eval", out, "--reference", tiny_qwen3_vl["fp8"], "--text",
              TEXT_DIR / "calib.txt", "--samples", "2", "--seq-len", "32")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert "top-1" in res.stdout and "KL" in res.stdout
