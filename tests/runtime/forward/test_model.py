"""The reference DeepSeek-V3 forward against its definition and against Hugging Face transformers.

Differential tests build transformers' native ``DeepseekV3ForCausalLM`` (``pip install
"transformers>=5"``) from the same config and float32 weights and compare logits and the experts
every token is routed to. They skip only when transformers cannot be imported.

Tolerance: both sides run float32 and differ only in summation order. One float32 dot product of
length K is off by at most K·u relative (u = 2^-24), so logits must agree within
``4 · K_max · u · max|logit|`` (K_max = the longest reduction of the config; ≈ 9e-5 relative for
the tiny model). A semantic slip (rope layout, YaRN, mscale, group scoring, bias use) moves logits
by O(1) — more than 10^4 times that.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from support import make_kimi_k2

from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats.families import ModelConfig, expected_tensors
from hetquant.runtime.forward.model import DeepseekV3Reference, DenseWeights
from hetquant.runtime.forward.moe import RouterSpec, route
from hetquant.runtime.forward.rope import RopeSpec, apply_rope, cos_sin, inv_freq, yarn_mscale
from hetquant.runtime.serving.run import RunSpec, run_artifact

try:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
except ImportError:  # the only reason to skip
    DeepseekV3Config = DeepseekV3ForCausalLM = None

needs_hf = pytest.mark.skipif(
    DeepseekV3ForCausalLM is None, reason="transformers not installed (pip install transformers)"
)
TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-deepseek-v3"
U = 2.0**-24


def _tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The embedded FP8 checkpoint, dequantized to float32 (DeepSeek's formula), MTP layer left out."""
    src = SourceCheckpoint.open(TINY)
    cfg = src.config
    state = {}
    for name, t in src.tensors.items():
        if t.role.mtp:
            continue
        state[name] = src.dequantized(name).to(torch.float32)  # FP8: DeepSeek's formula
    return cfg, state


def _synthetic(changes: dict, seed: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random float32 model of the tiny config with ``changes`` (no MTP layer)."""
    raw = copy.deepcopy(SourceCheckpoint.open(TINY).config.raw)
    raw.pop("quantization_config")
    raw.update({"num_nextn_predict_layers": 0, **changes})
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, role in expected_tensors(cfg).items():
        x = torch.randn(role.shape, generator=gen)
        kind = role.role.kind
        if kind == "norm":
            x = 1 + 0.1 * x
        elif kind == "bias":
            x = 0.1 * x
        elif kind in ("linear", "router") or name == "lm_head.weight":
            x = x / math.sqrt(role.shape[1])
        state[name] = x
    return cfg, state


def _strong_bias(cfg: ModelConfig, state: dict, seed: int = 1) -> dict:
    """``state`` with e_score_correction_bias large enough to change which experts win."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in state:
        if name.endswith("e_score_correction_bias"):
            out[name] = 0.3 * torch.randn(state[name].shape, generator=gen)
    return out


class Recording(DenseWeights):
    """DenseWeights that records each MoE layer's input and expert choice."""

    def __init__(self, state: dict, cfg: ModelConfig) -> None:
        super().__init__(state, cfg.family)
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def experts(self, layer, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        self.calls[layer] = (x.clone(), topk_ids.sort(-1).values)
        return super().experts(layer, x, topk_ids, topk_weights)


def _hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """transformers' DeepseekV3ForCausalLM with ``state`` (experts stacked as it stores them)."""
    raw = {k: v for k, v in cfg.raw.items() if k not in ("quantization_config", "auto_map")}
    hf_cfg = DeepseekV3Config.from_dict(raw, attn_implementation="eager", rope_interleave=True)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_cfg).eval().to(torch.float32)
    hf_state = {n: t for n, t in state.items() if ".mlp.experts." not in n}
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        p, experts = f"model.layers.{layer}.mlp.experts", range(cfg.n_routed_experts)
        hf_state[f"{p}.gate_up_proj"] = torch.stack(  # [E, 2I, H]: gate rows, then up rows
            [
                torch.cat([state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        hf_state[f"{p}.down_proj"] = torch.stack(
            [state[f"{p}.{e}.down_proj.weight"] for e in experts]
        )
    model.load_state_dict(hf_state, strict=True)
    return model


def _tolerance(cfg: ModelConfig, logits: torch.Tensor) -> float:
    heads = cfg.num_attention_heads
    k_max = max(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1),
        heads * cfg.v_head_dim,
        cfg.kv_lora_rank,
        cfg.q_lora_rank or 0,
    )
    return 4 * k_max * U * float(logits.abs().max())


VARIANTS = {
    "tiny": None,
    "tiny-strong-bias": None,
    # q_proj (no q LoRA), YaRN with mscale != mscale_all_dim, 4 groups keep 2, top-3, 2 shared
    "q_proj-yarn-mscale": dict(
        q_lora_rank=None,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        max_position_embeddings=2048,
        rope_scaling=dict(
            type="yarn",
            factor=8,
            original_max_position_embeddings=256,
            beta_fast=32,
            beta_slow=1,
            mscale=0.9,
            mscale_all_dim=0.6,
        ),
    ),
    # plain RoPE, every layer MoE, one group
    "plain-rope-all-moe": dict(rope_scaling=None, first_k_dense_replace=0, n_group=1, topk_group=1),
}


@needs_hf
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(variant: str, tiny) -> None:  # type: ignore[no-untyped-def]
    if variant.startswith("tiny"):
        cfg, state = tiny
        if variant == "tiny-strong-bias":
            state = _strong_bias(cfg, state)
    else:
        cfg, state = _synthetic(VARIANTS[variant], seed=len(variant))
    tokens = _tokens(48, cfg.vocab_size)
    weights = Recording(state, cfg)
    ours = DeepseekV3Reference(cfg, weights).forward(tokens)

    model = _hf_model(cfg, state)
    hf_ids: dict[int, torch.Tensor] = {}
    for layer in weights.calls:
        gate = model.model.layers[layer].mlp.gate
        gate.register_forward_hook(
            lambda _m, _i, out, layer=layer: hf_ids.__setitem__(layer, out[2])
        )
    with torch.no_grad():
        theirs = model(tokens[None]).logits[0].to(torch.float32)

    assert ours.shape == (tokens.numel(), cfg.vocab_size)
    for layer, (_, ids) in weights.calls.items():  # identical expert choice for every token
        assert torch.equal(ids, hf_ids[layer].sort(-1).values), f"layer {layer} routing"
    diff = float((ours - theirs).abs().max())
    assert diff <= _tolerance(cfg, theirs), f"max |Δlogit| {diff:.3g}"


@needs_hf
def test_greedy_matches_transformers(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, state = tiny
    prompt = _tokens(8, cfg.vocab_size, seed=3)
    ours = DeepseekV3Reference(cfg, DenseWeights(state, cfg.family)).generate(prompt, 6)
    with torch.no_grad():
        theirs = _hf_model(cfg, state).generate(prompt[None], max_new_tokens=6, do_sample=False)[0]
    assert torch.equal(ours[: theirs.numel()], theirs)


@pytest.mark.parametrize("variant", ["tiny", "tiny-strong-bias", "q_proj-yarn-mscale"])
def test_routing_rules_are_exercised(variant: str, tiny) -> None:  # type: ignore[no-untyped-def]
    """The differential inputs make group limiting (and, strongly biased, the bias) matter."""
    cfg, state = tiny if variant.startswith("tiny") else _synthetic(VARIANTS[variant], len(variant))
    if variant == "tiny-strong-bias":
        state = _strong_bias(cfg, state)
    weights = Recording(state, cfg)
    model = DeepseekV3Reference(cfg, weights)
    model.forward(_tokens(48, cfg.vocab_size))
    spec = model.router
    no_groups = dataclasses.replace(spec, n_group=1, topk_group=1)
    changed_by_groups = changed_by_bias = 0
    for layer, (x, ids) in weights.calls.items():
        p = f"model.layers.{layer}.mlp.gate"
        logits = x @ state[f"{p}.weight"].T
        bias = state[f"{p}.e_score_correction_bias"]
        free = route(logits, bias, no_groups)[0].sort(-1).values
        unbiased = route(logits, torch.zeros_like(bias), spec)[0].sort(-1).values
        changed_by_groups += int((free != ids).any(-1).sum())
        changed_by_bias += int((unbiased != ids).any(-1).sum())
    assert changed_by_groups > 0
    if variant == "tiny-strong-bias":
        assert changed_by_bias > 0


def test_route_hand_example() -> None:
    """4 experts in 2 groups, keep 1 group, top-2; weights are the unbiased normalised scores."""
    spec = RouterSpec(4, 2, 2, 1, "sigmoid", True, True, 2.5)
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.8, 0.7]]))
    ids, w = route(logits, torch.zeros(4), spec)  # groups score 1.0 vs 1.5: group 1 wins
    assert ids.sort().values.tolist() == [[2, 3]]  # although expert 0 scores best
    torch.testing.assert_close(
        w.sort(descending=True).values, torch.tensor([[0.8, 0.7]]) / 1.5 * 2.5
    )
    ids, w = route(logits, torch.tensor([0.0, 0.2, -0.5, 0.0]), spec)  # biased: 1.2 vs 1.0
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.1]]) * 2.5)


def test_rope_is_the_complex_pair_rotation() -> None:
    """Pairs (2i, 2i+1) times exp(j·t·ω_i); equal q·k to the [evens | odds] rotate_half form."""
    spec = RopeSpec.from_config({"rope_theta": 10000, "rope_scaling": None}, 16)
    t = torch.arange(7)
    cos, sin = cos_sin(spec, t)  # [T, 8]
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(0))  # [T, H, d]
    want = torch.view_as_complex(x.view(7, 3, 8, 2)) * torch.polar(
        torch.ones(7, 1, 8), t[:, None, None] * inv_freq(spec)
    )
    torch.testing.assert_close(apply_rope(x, cos, sin), torch.view_as_real(want).flatten(2))
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])  # HF remote code's permute
    xp = x[..., perm]
    c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    half = xp * c + torch.cat([-xp[..., 8:], xp[..., :8]], -1) * s
    torch.testing.assert_close(half, apply_rope(x, cos, sin)[..., perm])


def test_yarn_frequencies_and_mscale() -> None:
    yarn = dict(type="yarn", factor=40, original_max_position_embeddings=4096)
    yarn.update(beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    spec = RopeSpec.from_config({"rope_theta": 10000, "rope_scaling": yarn}, 64)  # DeepSeek-V3's
    plain = inv_freq(RopeSpec(64, 10000.0))
    got = inv_freq(spec)
    # correction dims for 32 and 1 turns over 4096 positions: 10.5 → 10 and 22.5 → 23
    torch.testing.assert_close(got[:11], plain[:11])  # fast dims: extrapolated (unchanged)
    torch.testing.assert_close(got[23:], plain[23:] / 40)  # slow dims: interpolated
    assert ((got[11:23] < plain[11:23]) & (got[11:23] > plain[11:23] / 40)).all()
    assert spec.softmax_mscale == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert spec.cos_sin_scale == 1.0 and yarn_mscale(1.0, 1.0) == 1.0


def test_causal(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, state = tiny
    model = DeepseekV3Reference(cfg, DenseWeights(state, cfg.family))
    a = _tokens(32, cfg.vocab_size, seed=5)
    b = a.clone()
    b[20:] = _tokens(12, cfg.vocab_size, seed=6)
    la, lb = model.forward(a), model.forward(b)
    torch.testing.assert_close(la[:20], lb[:20], rtol=1e-5, atol=1e-5)
    assert (la[20:] - lb[20:]).abs().max() > 1e-2


def test_generate_is_deterministic_greedy(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, state = tiny
    model = DeepseekV3Reference(cfg, DenseWeights(state, cfg.family))
    prompt = _tokens(6, cfg.vocab_size, seed=7)
    first, second = model.generate(prompt, 5), model.generate(prompt, 5)
    assert torch.equal(first, second) and torch.equal(first[:6], prompt)
    for i in range(6, 11):
        assert first[i] == model.forward(first[:i])[-1].argmax()


def test_expert_hook_carries_all_routed_experts(tiny) -> None:  # type: ignore[no-untyped-def]
    """A provider without routed-expert tensors (e.g. a CPU pool) gives identical logits."""
    cfg, state = tiny
    pool = {n: t for n, t in state.items() if ".mlp.experts." in n}

    class Pooled(DenseWeights):
        def experts(self, layer, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
            return DenseWeights(pool, cfg.family).experts(layer, x, topk_ids, topk_weights)

    tokens = _tokens(16, cfg.vocab_size)
    rest = {n: t for n, t in state.items() if n not in pool}
    torch.testing.assert_close(
        DeepseekV3Reference(cfg, Pooled(rest, cfg.family)).forward(tokens),
        DeepseekV3Reference(cfg, DenseWeights(state, cfg.family)).forward(tokens),
        rtol=0,
        atol=0,
    )


@needs_hf
@pytest.mark.parametrize("variant", ["instruct", "thinking"])
def test_kimi_k2_artifact_runs_as_transformers(variant: str, tmp_path: Path) -> None:
    """``hetquant run`` on the bf16 artifact of a tiny Kimi K2 (model_type kimi_k2, flat top-k,
    routed scaling 2.827, YaRN with beta_fast 1, no MTP; FP8 or INT4-expert source) gives
    transformers' DeepseekV3 logits for the K2-shaped config, within the float32 bound."""
    src = SourceCheckpoint.open(make_kimi_k2(tmp_path / "src", variant))
    cfg = src.config
    assert (cfg.raw["model_type"], cfg.family.name, cfg.num_mtp_layers) == (
        "kimi_k2",
        "deepseek_v3",
        0,
    )
    state = {n: src.dequantized(n).to(torch.float32) for n in src.tensors}
    convert(src, tmp_path / "art", get_recipe("bf16"), max_shard_size=1 << 40)
    tokens = _tokens(48, cfg.vocab_size, seed=11)
    ours, _ = run_artifact(RunSpec(str(tmp_path / "art"), tuple(tokens.tolist())))
    with torch.no_grad():
        theirs = _hf_model(cfg, state)(tokens[None]).logits[0].to(torch.float32)
    diff = float((torch.from_numpy(ours) - theirs).abs().max())
    assert diff <= _tolerance(cfg, theirs), f"max |Δlogit| {diff:.3g}"
