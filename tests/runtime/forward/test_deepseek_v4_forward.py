"""The reference DeepSeek-V4 forward against transformers 5.24's ``DeepseekV4ForCausalLM`` (eval,
float32, eager) on the tiny V4 (``examples/tiny-deepseek-v4/make_tiny.py``: sliding, CSA and HCA
layers, a hash-routed and top-k MoE layers, an MTP layer in DeepSeek's layout), single rank and
sharded, from the bf16 artifacts ``hetquant convert`` makes of both source layouts.

Prompts are longer than the sliding window (8), than the CSA rate (4) times the indexer's top-k
(4) — so the indexer chooses — and than the HCA rate (128), so every attention path contributes.
Tolerance as ``test_qwen3_moe_forward.py`` argues it: float32 on both sides, summation order
only — ``4 · K_max · u · max|logit|`` single rank, ``(4 + 8 · layers) · K_max · u · max|logit|``
sharded (u = 2^-24). A semantic slip (window edge, overlap layout, sink, rope slice, Sinkhorn
direction, clip, hash table) moves logits by O(0.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats import HetquantError
from hetquant.formats.families import ModelConfig
from hetquant.runtime.forward.deepseek_v4 import DeepseekV4Reference, attention_spec
from hetquant.runtime.forward.model import DenseWeights
from hetquant.runtime.forward.references import reference_for
from hetquant.runtime.forward.rope import cos_sin
from hetquant.runtime.serving.run import RunSpec, local_model, run_artifact

transformers = pytest.importorskip("transformers")  # the comparison's other side

U = 2.0**-24
T = 140  # > HCA rate 128
TOKENS = tuple(torch.randint(0, 640, (T,), generator=torch.Generator().manual_seed(7)).tolist())


def _state(root: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config and every tensor, weights dequantized exactly (floats as float32)."""
    src = SourceCheckpoint.open(root)
    state = {n: src.dequantized(n) for n in src.tensors}
    return src.config, {n: t.float() if t.is_floating_point() else t for n, t in state.items()}


def _hf_logits(root: Path, tokens: tuple[int, ...] = TOKENS) -> torch.Tensor:
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(
        root, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0]


def _k_max(cfg: ModelConfig) -> int:
    return max(cfg.hidden_size * cfg.hc_mult, cfg.num_attention_heads * cfg.head_dim,
               cfg.q_lora_rank, cfg.moe_intermediate_size)  # fmt: skip


def _variant(src: Path, dst: Path, edit: dict) -> Path:
    """``src`` (transformers' layout) with config.json edited; the weights shared."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    raw = json.loads((src / "config.json").read_text())
    for key, value in edit.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
         "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0,
         "rope_theta": 160000.0, "partial_rotary_factor": 0.25}  # fmt: skip
VARIANTS = {
    "tiny": {},
    "active-swiglu-clip": {"swiglu_limit": 0.05},  # gate / up pre-activations reach ±0.5
    "yarn-compress-rope": {"rope_parameters": {"compress": _YARN}},
    "window-3-top-2-sinkhorn-3": {"sliding_window": 3, "index_topk": 2, "hc_sinkhorn_iters": 3},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(variant: str, tiny_v4: dict[str, Path], tmp_path: Path) -> None:
    root = tiny_v4["transformers"]
    if VARIANTS[variant]:
        root = _variant(root, tmp_path / variant, VARIANTS[variant])
    cfg, state = _state(root)
    ours = DeepseekV4Reference(cfg, DenseWeights(state, cfg.family)).forward(torch.tensor(TOKENS))
    theirs = _hf_logits(root)
    diff = float((ours - theirs).abs().max())
    assert diff <= 4 * _k_max(cfg) * U * float(theirs.abs().max()), f"max |Δlogit| {diff:.3g}"
    assert float(theirs.std()) > 0.1


def test_vllm_dims_match_transformers(tiny_v4_vllm: dict[str, Path]) -> None:
    """The generator's ``--dims vllm`` variant (head_dim 512, rope 64, index_head_dim 128: what
    vLLM's CPU build serves) through the reference forward equals transformers too, from either
    layout (DeepSeek's FP8 / FP4 source dequantized exactly holds the same model)."""
    theirs = _hf_logits(tiny_v4_vllm["transformers"])
    assert float(theirs.std()) > 0.1
    for layout, root in tiny_v4_vllm.items():
        cfg, state = _state(root)
        assert (cfg.head_dim, cfg.index_head_dim) == (512, 128)
        model = DeepseekV4Reference(cfg, DenseWeights(state, cfg.family))
        diff = float((model.forward(torch.tensor(TOKENS)) - theirs).abs().max())
        assert diff <= 4 * _k_max(cfg) * U * float(theirs.abs().max()), f"{layout}: {diff:.3g}"


def test_every_attention_path_contributes(tiny_v4: dict[str, Path]) -> None:
    """Perturbing a path's weights moves exactly the positions that path reaches: the HCA
    compressor from position 127 on (its first entry closes there), the indexer's scoring once a
    query sees more CSA entries than it keeps (4 · 4 + 3 = 19), the sinks everywhere."""
    cfg, state = _state(tiny_v4["transformers"])
    tokens = torch.tensor(TOKENS)
    base = DeepseekV4Reference(cfg, DenseWeights(state, cfg.family)).forward(tokens)
    for name, first in (("model.layers.2.attn.compressor.ape", 127),
                        ("model.layers.1.attn.indexer.weights_proj.weight", 19),
                        ("model.layers.0.attn.attn_sink", 0)):  # fmt: skip
        noise = torch.randn(state[name].shape, generator=torch.Generator().manual_seed(first))
        bent = dict(state, **{name: state[name] + noise})  # not a constant: softmax ignores one
        out = DeepseekV4Reference(cfg, DenseWeights(bent, cfg.family)).forward(tokens)
        moved = (out - base).abs().amax(-1) > 1e-4  # [T]
        assert not moved[:first].any() and moved[first:].any(), name


@pytest.fixture(scope="module")
def artifacts(tiny_v4: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("v4-run")
    out = {}
    for layout, src in tiny_v4.items():
        out[layout] = base / layout
        convert(SourceCheckpoint.open(src), out[layout], get_recipe("bf16"), max_shard_size=1 << 20)
    return out


@pytest.mark.parametrize(
    ("source", "layout"),
    [("deepseek", {}), ("deepseek", {"tp": 2}), ("deepseek", {"pp": 2, "ep": 2}),
     ("transformers", {}), ("transformers", {"tp": 2})],
)  # fmt: skip
def test_bf16_artifact_run_matches_transformers(
    source: str, layout: dict, artifacts: dict, tiny_v4: dict[str, Path]
) -> None:
    """The bf16 artifact of either layout, run on one rank or sharded, equals transformers."""
    logits, gen = run_artifact(RunSpec(str(artifacts[source]), TOKENS, generate=1, **layout))
    theirs = _hf_logits(tiny_v4["transformers"])
    cfg = SourceCheckpoint.open(tiny_v4["transformers"]).config
    layers = cfg.num_hidden_layers
    tol = (4 + (8 * layers if layout else 0)) * _k_max(cfg) * U * float(theirs.abs().max())
    diff = float((torch.from_numpy(logits) - theirs).abs().max())
    assert diff <= tol, f"{source} {layout}: max |Δlogit| {diff:.3g} > {tol:.3g}"
    assert gen == [int(theirs[-1].argmax())]


def test_greedy_matches_transformers(artifacts: dict, tiny_v4: dict[str, Path]) -> None:
    """Greedy, a full prefill per token on both sides. (transformers' ``generate`` with its cache
    is not the reference: on this model its cached decode at position 131, where a CSA window
    closes, differs from its own prefill by 0.40 in the logits — measured with transformers
    5.24 — and picks another token there.)"""
    prompt = list(TOKENS[:130])
    ours = local_model(artifacts["deepseek"]).generate(torch.tensor(prompt), 4)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tiny_v4["transformers"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            nxt = hf(seq, use_cache=False).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    assert torch.equal(ours, seq[0])


def test_mtp_kept_or_dropped_runs_the_same(tiny_v4: dict[str, Path], tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """The MTP layer is not part of the forward: a hybrid artifact with it and one without give
    the same logits (the loader leaves a kept MTP layer on disk)."""
    outs = {}
    for mtp in ("keep", "drop"):
        out = tmp_path / mtp
        res = cli("convert", tiny_v4["deepseek"], out, "--recipe", "ascend-hybrid", "--mtp", mtp)
        assert res.exit_code == 0, res.stderr
        assert (
            any(".mtp." in n or n.startswith("mtp.") for n in local_model(out).weights.t) is False
        )
        outs[mtp] = local_model(out).forward(torch.tensor(TOKENS[:20])).numpy()
    assert np.array_equal(outs["keep"], outs["drop"])


def test_deepseek_config_ropes_are_transformers(tiny_v4: dict[str, Path]) -> None:
    """DeepSeek's flat config (``rope_scaling`` YaRN, ``compress_rope_theta``) gives the
    frequencies transformers derives from it; the main rope stays plain."""
    raw = json.loads((tiny_v4["deepseek"] / "config.json").read_text())
    raw["rope_scaling"] = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                           "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    spec = attention_spec(ModelConfig.from_dict(raw))
    hf_cfg = transformers.DeepseekV4Config(**{k: v for k, v in raw.items()
                                              if k not in ("architectures", "model_type")})  # fmt: skip
    rot = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(hf_cfg)
    pos = torch.arange(300)
    for which, rope in (("main", spec.main), ("compress", spec.compress)):
        cos, sin = rot(torch.zeros(1), pos[None], layer_type=which)
        ours = cos_sin(rope, pos)
        torch.testing.assert_close(ours[0], cos[0], atol=2e-6, rtol=0)
        torch.testing.assert_close(ours[1], sin[0], atol=2e-6, rtol=0)
    assert spec.main.yarn is None and spec.compress.yarn is not None


@pytest.mark.parametrize(
    ("edit", "match"),
    [({"scoring_func": "softmax"}, "scoring_func"),
     ({"hidden_act": "gelu"}, "hidden_act"),
     ({"rope_parameters": {"compress": {**_YARN, "attention_factor": 1.2}}}, "attention_factor"),
     ({"rope_parameters": {"compress": {k: v for k, v in _YARN.items()
                                        if k != "attention_factor"}}}, "attention_factor is None")],
)  # fmt: skip
def test_refusals_name_the_field(
    edit: dict, match: str, tiny_v4: dict[str, Path], tmp_path: Path
) -> None:
    root = _variant(tiny_v4["transformers"], tmp_path / "bad", edit)
    cfg = ModelConfig.load(root / "config.json")
    assert reference_for(cfg) is DeepseekV4Reference
    with pytest.raises(HetquantError, match=match) as e:
        DeepseekV4Reference(cfg, DenseWeights({}, cfg.family))
    assert len(str(e.value).splitlines()) == 1
