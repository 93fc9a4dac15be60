"""The reference Qwen3-MoE forward against transformers' ``Qwen3MoeForCausalLM``, single rank and
sharded (TP2, EP2 × PP2: ranks spawned on this host, gloo).

Tolerance, as tests/runtime/test_model.py and test_run.py argue it: both sides run float32 and
differ only in summation order, so logits agree within ``4 · K_max · u · max|logit|`` (u = 2^-24);
a sharded run reorders at most 2 more sums per layer (partial sums all-reduced): another
``2 · layers · K_max · u · max|logit|``, with a factor 4 of headroom. A semantic slip (rope
layout, q/k norm, GQA head mapping, softmax routing, renormalisation) moves logits by O(1).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig, expected_tensors
from hetquant.runtime.forward.model import DenseWeights
from hetquant.runtime.forward.qwen3_moe import Qwen3MoeReference, apply_rope_half
from hetquant.runtime.forward.references import reference_for
from hetquant.runtime.serving.run import RunSpec, local_model, run_artifact

try:
    from transformers import Qwen3MoeConfig as HfConfig
    from transformers import Qwen3MoeForCausalLM
except ImportError:  # the only reason to skip
    HfConfig = Qwen3MoeForCausalLM = None

needs_hf = pytest.mark.skipif(
    Qwen3MoeForCausalLM is None, reason="transformers not installed (pip install transformers)"
)
U = 2.0**-24
TOKENS = (5, 17, 42, 100, 7, 300, 250, 11, 639, 0, 64, 128)


def _dequantized(root: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    src = SourceCheckpoint.open(root)
    return src.config, {n: src.dequantized(n).to(torch.float32) for n in src.tensors}


def _synthetic(base: ModelConfig, changes: dict, seed: int):  # type: ignore[no-untyped-def]
    raw = {k: v for k, v in base.raw.items() if k != "quantization_config"} | changes
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, role in expected_tensors(cfg).items():
        x = torch.randn(role.shape, generator=gen)
        state[name] = 1 + 0.1 * x if len(role.shape) == 1 else x / math.sqrt(role.shape[1])
    return cfg, state


def _hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """transformers' Qwen3MoeForCausalLM with ``state`` (experts stacked as it stores them)."""
    raw = {k: v for k, v in cfg.raw.items() if k != "quantization_config"}
    model = Qwen3MoeForCausalLM(HfConfig.from_dict(raw, attn_implementation="eager"))
    model = model.eval().to(torch.float32)
    hf = {n: t for n, t in state.items() if ".mlp.experts." not in n}
    for layer in cfg.moe_layers:
        p, experts = f"model.layers.{layer}.mlp.experts", range(cfg.num_experts)
        hf[f"{p}.gate_up_proj"] = torch.stack(  # [E, 2I, H]: gate rows, then up rows
            [torch.cat([state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]])
             for e in experts]
        )  # fmt: skip
        hf[f"{p}.down_proj"] = torch.stack([state[f"{p}.{e}.down_proj.weight"] for e in experts])
    model.load_state_dict(hf, strict=True)
    return model


def _k_max(cfg: ModelConfig) -> int:
    return max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size,
               cfg.num_attention_heads * cfg.head_dim)  # fmt: skip


def _hf_logits(cfg: ModelConfig, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(cfg, state)(tokens[None]).logits[0].to(torch.float32)


VARIANTS = {
    "tiny-fp8": None,
    # no GQA, every other layer dense (decoder_sparse_step), top-3 without renormalisation
    "mha-sparse-step-unnormalised": dict(
        num_key_value_heads=8,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        num_experts_per_tok=3,
        norm_topk_prob=False,
    ),
    # one KV head for 8 query heads, head_dim 64, every layer MoE
    "mqa-head64": dict(num_key_value_heads=1, head_dim=64, mlp_only_layers=[]),
}


@needs_hf
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(variant: str, tiny_qwen3: dict[str, Path]) -> None:
    cfg, state = _dequantized(tiny_qwen3["fp8"])
    if VARIANTS[variant] is not None:
        cfg, state = _synthetic(cfg, VARIANTS[variant], seed=len(variant))
    tokens = torch.tensor(TOKENS)
    ours = Qwen3MoeReference(cfg, DenseWeights(state, cfg.family)).forward(tokens)
    theirs = _hf_logits(cfg, state, tokens)
    assert ours.shape == (len(TOKENS), cfg.vocab_size)
    diff = float((ours - theirs).abs().max())
    assert diff <= 4 * _k_max(cfg) * U * float(theirs.abs().max()), f"max |Δlogit| {diff:.3g}"
    assert float(theirs.std()) > 0.1  # the comparison is not between two near-zero tensors


@needs_hf
def test_greedy_matches_transformers(tiny_qwen3: dict[str, Path]) -> None:
    cfg, state = _dequantized(tiny_qwen3["bf16"])
    prompt = torch.tensor(TOKENS[:6])
    ours = Qwen3MoeReference(cfg, DenseWeights(state, cfg.family)).generate(prompt, 6)
    with torch.no_grad():
        hf = _hf_model(cfg, state)
        theirs = hf.generate(prompt[None], max_new_tokens=6, do_sample=False)[0]
    assert torch.equal(ours[: theirs.numel()], theirs)


@pytest.fixture(scope="module")
def bf16_artifact(tiny_qwen3: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-run") / "bf16"
    convert(SourceCheckpoint.open(tiny_qwen3["fp8"]), out, get_recipe("bf16"),
            max_shard_size=1 << 20)  # fmt: skip
    return out


@needs_hf
@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2), dict(ep=2, pp=2)])
def test_sharded_run_matches_transformers(
    layout: dict, bf16_artifact: Path, tiny_qwen3: dict[str, Path]
) -> None:
    """The bf16 artifact of the FP8 source (exact dequantization), run sharded, against
    transformers on the same dequantized weights."""
    cfg, state = _dequantized(tiny_qwen3["fp8"])
    logits, _ = run_artifact(RunSpec(str(bf16_artifact), TOKENS, **layout))
    theirs = _hf_logits(cfg, state, torch.tensor(TOKENS))
    tol = (4 + 8 * cfg.num_hidden_layers) * _k_max(cfg) * U * float(theirs.abs().max())
    diff = float((torch.from_numpy(logits) - theirs).abs().max())
    assert diff <= tol, f"{layout}: max |Δlogit| {diff:.3g} > {tol:.3g}"


def test_hybrid_tp2_with_a_two_subpool_cpu_pool(
    tiny_qwen3: dict[str, Path], tmp_path: Path
) -> None:
    """ascend-hybrid (W8A8 attention and dense MLP, routed experts in the CPU INT4 pool)."""
    out = tmp_path / "hybrid"
    convert(SourceCheckpoint.open(tiny_qwen3["bf16"]), out, get_recipe("ascend-hybrid"),
            max_shard_size=1 << 40)  # fmt: skip
    cfg = SourceCheckpoint.open(tiny_qwen3["bf16"]).config
    one = local_model(out).forward(torch.tensor(TOKENS)).numpy()
    tp2, _ = run_artifact(RunSpec(str(out), TOKENS, tp=2))
    tp2_sp2, gen = run_artifact(RunSpec(str(out), TOKENS, tp=2, subpools=2, generate=2))
    # subpools split each expert's intermediate dim: partial sums in another order only
    tol = 4 * 2 * cfg.num_hidden_layers * _k_max(cfg) * U * float(abs(tp2).max())
    assert float(abs(tp2_sp2 - tp2).max()) <= tol
    # TP2 quantizes each rank's slice of a row-parallel W8A8 input with its own per-token scale
    # (as vllm-ascend does): within the 8-bit activation error of the single rank (test_run.py)
    assert float(abs(tp2_sp2 - one).max()) <= 0.05 * float(abs(one).max())
    assert len(gen) == 2


def test_rope_half_is_the_rotate_half_form() -> None:
    """[x1 | x2] → [x1·c − x2·s | x2·c + x1·s] equals x·cos + rotate_half(x)·sin."""
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    ang = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    cos, sin = ang.cos(), ang.sin()
    rot = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    want = x * torch.cat([cos, cos], -1)[:, None] + rot * torch.cat([sin, sin], -1)[:, None]
    torch.testing.assert_close(apply_rope_half(x, cos, sin), want)


def test_dispatch_by_family_and_refusals(tiny_qwen3: dict[str, Path]) -> None:
    cfg, state = _dequantized(tiny_qwen3["fp8"])
    assert reference_for(cfg) is Qwen3MoeReference
    for change in ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                   {"use_sliding_window": True}, {"tie_word_embeddings": True}):  # fmt: skip
        bad = ModelConfig.from_dict({**cfg.raw, **change})
        with pytest.raises(HetquantError, match=next(iter(change))):
            Qwen3MoeReference(bad, DenseWeights(state, cfg.family))
