"""``examples/tiny-tools/train.py --smoke``: it trains, and ships what it trained.

One smoke run (20 CPU steps, tiny dims, ``pydoc_data.topics`` text) into a temporary folder,
then:

- the loss falls;
- the checkpoint opens with ``SourceCheckpoint`` and is laid out as DeepSeek ships V3 / R1;
- every stored weight is its trained float value up to the rounding of its stored format;
- ``hetquant.runtime.forward.model`` on the dequantized checkpoint equals the training module on the same
  dequantized weights (float32 summation-order tolerance: the module *is* the runtime's model);
- ``hetquant.runtime.forward.model`` on the dequantized checkpoint matches the training module on the
  *float* weights within the FP8 rounding tolerance, derived below;
- a second run with the same seed writes the same bytes.

FP8 tolerance. Round-to-nearest E4M3 (3 mantissa bits) moves a normal value by at most half an
ulp, ``|ŵ − w| ≤ 2^-4·|w|`` (the ulp is 2^-3 of the value's power of two); DeepSeek's
dequantization adds a BF16 rounding (``2^-8`` relative: 8 significant bits), and block
subnormals (``|w| < 2^-6·s``) move by at most ``2^-10·s`` absolute. BF16 tensors (norms,
embeddings, router, ``eh_proj``) move by ``≤ 2^-8·|w|``.
So the quantized model is the float model with every weight scaled by ``(1 + δ)``,
``|δ| ≤ u`` (``u = 2^-4 + 2^-8`` for FP8 linears, ``2^-8`` for BF16 tensors, 0 for the F32 bias),
the δ of unrelated values independent. A *twin* model with δ drawn uniformly in ``[−u, u]``
has the same per-weight bound and a larger error spread (RNE's error is uniform within half an
ulp, which is below the bound for every mantissa but 1.0: rms ≈ 0.027 relative for E4M3 against
the twin's 0.038). Its logit deviation from the float model — through the same network, router
decisions flipped by the perturbation included, which dominate in a barely trained model — is
the deviation that rounding within these bounds causes. The FP8 checkpoint may deviate up to
2× the mean of three twins (the twins' own spread is ±15%). A layout bug (a scale applied to
the wrong block, a misplaced or transposed tensor) moves the logits by their whole spread.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hetquant.convert import SourceCheckpoint
from hetquant.runtime.forward.model import DeepseekV3Reference, DenseWeights

TOOLS = Path(__file__).resolve().parents[2] / "examples" / "tiny-tools"
FP8_U = 2.0**-4  # E4M3 round-to-nearest, relative, normal values
BF16_U = 2.0**-8  # BF16 round-to-nearest (8 significant bits), relative
N_EVAL = 4  # held-out windows compared


def _load_train() -> ModuleType:
    name = "_tiny_deepseek_v3_train"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / "train.py")
    module = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in examples/
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = saved
    return module


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return _load_train()


@pytest.fixture(scope="module")
def smoke(train: ModuleType, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("smoke") / "ckpt"
    return train.run(["--smoke", "--out", str(out)])


@pytest.fixture(scope="module")
def float_state(smoke) -> dict[str, torch.Tensor]:
    return smoke.model.hf_state()


@pytest.fixture(scope="module")
def dequantized(train: ModuleType, smoke):
    return train.read_checkpoint(smoke.out)  # (ModelConfig, float32 state)


@pytest.fixture(scope="module")
def samples(smoke) -> torch.Tensor:
    return smoke.heldout[:N_EVAL]


def _module_logits(train: ModuleType, config: dict, state: dict, samples: torch.Tensor):
    model = train.Model(config)
    model.load_hf_state(state)
    with torch.no_grad():
        return torch.stack([model(s[None, :-1])[0][0] for s in samples])  # [n, T, V]


def _runtime_logits(cfg, state: dict, samples: torch.Tensor) -> torch.Tensor:
    ref = DeepseekV3Reference(cfg, DenseWeights(state, cfg.family))
    return torch.stack([ref(s[:-1]) for s in samples])


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


# ------------------------------------------------------------------------------------------------


def test_loss_decreases(smoke) -> None:
    losses, mtp = smoke.losses, smoke.mtp_losses
    assert len(losses) == len(mtp) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5, losses
    assert sum(mtp[-5:]) / 5 < sum(mtp[:3]) / 3 - 0.5, mtp
    evals = smoke.report["evals"]
    assert evals[-1][1] < evals[0][1]  # held-out loss falls too


def test_checkpoint_is_deepseek_layout(train: ModuleType, smoke) -> None:
    out, config = smoke.out, smoke.config
    src = SourceCheckpoint.open(out)  # validates names, shapes, FP8 scales (any shard)
    assert src.config.raw == json.loads((out / "config.json").read_text())
    assert set(train.common.CONFIG) == set(config)  # every key of the real config.json
    n = config["num_hidden_layers"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{n + 2:06d}.safetensors" for i in range(1, n + 3)]
    headers = {f: _header(out / f) for f in shards}
    where = {name: f for f, h in headers.items() for name in h}
    assert index["weight_map"] == where
    dtype = {name: h[name]["dtype"] for h in headers.values() for name in h}
    assert index["metadata"]["total_size"] == sum(
        h[name]["data_offsets"][1] - h[name]["data_offsets"][0]
        for h in headers.values()
        for name in h
    )
    fp8 = {name for name, t in src.tensors.items() if t.fmt_name == "fp8_block"}
    linears = {name for name, t in src.tensors.items() if t.role.role.kind == "linear"}
    assert fp8 == linears - {f"model.layers.{n}.eh_proj.weight"}  # eh_proj stays BF16
    for name, d in dtype.items():
        if name.endswith("_scale_inv") or name.endswith("e_score_correction_bias"):
            assert d == "F32", name
        elif name in fp8:
            assert d == "F8_E4M3", name
        else:
            assert d == "BF16", name
    later_scale = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert where[later_scale + "_scale_inv"] > where[later_scale]
    later_weight = (
        f"model.layers.{n - 1}.mlp.experts.{config['n_routed_experts'] - 1}.down_proj.weight"
    )
    assert where[later_weight] > where[later_weight + "_scale_inv"]
    extras = [name for name, t in src.tensors.items() if t.role.role.scope == "mtp"]
    assert extras and {where[x] for x in extras} == {shards[-1]}
    mtp = f"model.layers.{n}"
    for copy, main in (
        (f"{mtp}.embed_tokens.weight", "model.embed_tokens.weight"),
        (f"{mtp}.shared_head.head.weight", "lm_head.weight"),
    ):
        assert torch.equal(src.weight(copy), src.weight(main))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == 0
    for f in ("tokenizer_config.json", "generation_config.json", "README.md"):
        assert (out / f).is_file()


def test_stored_weights_are_the_trained_ones_rounded(smoke, float_state, dequantized) -> None:
    out = smoke.out
    src = SourceCheckpoint.open(out)
    _, deq = dequantized
    assert set(deq) == set(float_state)
    for name, w in float_state.items():
        q = deq[name]
        t = src.tensors[name]
        if t.fmt_name == "fp8_block":
            s = src.stored(name)["weight_scale_inv"].float()
            s_full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[
                :, : w.shape[1]
            ]
            bound = FP8_U * w.abs() + BF16_U * q.abs() + 2.0**-10 * s_full
        elif name.endswith("e_score_correction_bias"):
            bound = torch.zeros_like(w)
        else:
            bound = BF16_U * w.abs()
        assert ((q - w).abs() <= bound * (1 + 1e-6)).all(), name


def test_runtime_equals_module_on_the_checkpoint(train, smoke, dequantized, samples) -> None:
    """Same (dequantized) weights, two implementations: summation-order tolerance only."""
    cfg, deq = dequantized
    ours = _module_logits(train, smoke.config, deq, samples)
    theirs = _runtime_logits(cfg, deq, samples)
    tol = train.summation_tolerance(cfg, samples.shape[1]) * float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) <= tol


def test_fp8_checkpoint_matches_float_module_within_fp8_tolerance(
    train, smoke, float_state, dequantized, samples
) -> None:
    cfg, deq = dequantized
    src = SourceCheckpoint.open(smoke.out)
    ref = _module_logits(train, smoke.config, float_state, samples)  # the trained float model
    fp8 = _runtime_logits(cfg, deq, samples)  # the shipped checkpoint through the runtime
    gen = torch.Generator().manual_seed(0)
    d_twins = []
    for _ in range(3):
        twin = {}
        for name, w in float_state.items():
            if name.endswith("e_score_correction_bias"):
                u = 0.0
            elif src.tensors[name].fmt_name == "fp8_block":
                u = FP8_U + BF16_U
            else:
                u = BF16_U
            delta = (torch.rand(w.shape, generator=gen, dtype=torch.float64) * 2 - 1) * u
            twin[name] = (w.double() * (1 + delta)).float()
        d_twins.append(_rms(_module_logits(train, smoke.config, twin, samples) - ref))
    d_fp8, d_twin = _rms(fp8 - ref), sum(d_twins) / len(d_twins)
    spread = _rms(ref - ref.mean(-1, keepdim=True))
    assert 0 < d_fp8 <= 2 * d_twin, (d_fp8, d_twins, spread)
    assert d_fp8 < 0.25 * spread  # and it is small against the logits themselves
    r = smoke.report
    assert abs(r["heldout_nll_fp8_runtime"] - r["heldout_nll_float"]) < 0.05


def test_same_seed_same_bytes(train, smoke, tmp_path: Path) -> None:
    again = train.run(["--smoke", "--out", str(tmp_path / "again")])
    assert again.losses == smoke.losses
    names = sorted(p.name for p in smoke.out.iterdir() if p.name != "README.md")
    assert names == sorted(p.name for p in again.out.iterdir() if p.name != "README.md")
    for name in names:
        a = hashlib.sha256((smoke.out / name).read_bytes()).hexdigest()
        b = hashlib.sha256((again.out / name).read_bytes()).hexdigest()
        assert a == b, name
