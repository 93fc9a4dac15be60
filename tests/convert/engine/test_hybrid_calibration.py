"""``ascend-hybrid --calib-data``: the routed CPU experts AWQ-calibrated with their own format as
the quantizer (``int4_cpu`` per row, or ``int4_cpu_group`` with ``--cpu-group-size``), the W8A8
linears written as the plain recipe writes them, the routing kept; ``--cpu-group-size``; refusals.

Routing bound. The MoE input balance folds ``diag(s)⁻¹`` into the norm before the router and
multiplies the router's columns by ``s``; both are stored in BF16 (unit roundoff 2⁻⁸), so each
product ``x_k · W_nk`` of a router logit moves by at most ``(1 + 2⁻⁸)² − 1 < 2⁻⁷ + 2⁻¹⁶``
relatively, plus float32 roundings of the folds (2⁻²⁴ each): ``|Δlogit_n| ≤ (2⁻⁷ + 2⁻¹²) ·
Σ_k |x_k W_nk|``. A wrong fold (norm not divided, router not compensated) moves logits by O(1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import REPO, make_kimi_k2, read_json, tree_hashes
from test_bad_input import assert_refused

from hetquant.calib import AwqOptions, calibrate
from hetquant.calib.data import load_tokenizer, token_blocks
from hetquant.calib.quantizer import quantizer_for
from hetquant.calib.transforms import apply_transform
from hetquant.convert import (
    SourceCheckpoint,
    calibrate_for,
    calibration_targets,
    convert,
    get_recipe,
    plan_for,
)
from hetquant.formats import int4_cpu, int4_cpu_group
from hetquant.formats.bits import unpack_nibbles_u8

TINY = REPO / "examples" / "tiny-deepseek-v3"
CALIB = ("--calib-samples", "4", "--calib-seq-len", "64")
ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
DEQUANTIZE = {None: int4_cpu.dequantize_expert, 32: int4_cpu_group.dequantize_expert}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model's matrices are too small for threads to help; on a loaded machine
    OpenMP's spinning threads slow calibration down many times (tests/calib/calib_consts.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Calibration text: CPython's pydoc topics (as tests/calib uses)."""
    import pydoc_data.topics as topics

    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("\n\n".join(topics.topics[k] for k in sorted(topics.topics)))
    return path


def _tensors(art: Path, file: str) -> dict[str, torch.Tensor]:
    with safe_open(str(art / file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _root(art: Path) -> dict[str, torch.Tensor]:
    index = read_json(art / "model.safetensors.index.json")["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index.values())):
        out.update(_tensors(art, file))
    return out


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory, text: Path) -> dict[str, Path]:
    return rtn_and_calibrated(tmp_path_factory.mktemp("hybrid-cal"), "ascend-hybrid", text)


def rtn_and_calibrated(base: Path, recipe: str, text: Path) -> dict[str, Path]:
    """The tiny model as ``recipe`` round-to-nearest and calibrated (``--workers 2``: the
    calibration is saved and read back by the workers), through the command line."""
    from support import run_cli

    runs = {"rtn": (), "awq": ("--calib-data", text, *CALIB, "--workers", "2")}
    for name, opts in runs.items():
        res = run_cli("convert", TINY, base / name, "--recipe", recipe, *opts)
        assert res.exit_code == 0, res.stderr
    return {name: base / name for name in runs}


def test_manifest_records_the_calibration_and_verify_passes(cli, hybrids) -> None:
    awq, rtn = (read_json(hybrids[k] / "hetquant.json") for k in ("awq", "rtn"))
    cal = awq["calibration"]
    assert cal["method"] == "awq" and cal["mtp"] == "rtn"
    assert (cal["tokens"]["samples"], cal["tokens"]["seq_len"]) == (4, 64)
    assert "calibration" not in rtn  # as before the hybrid calibrated (golden artifacts)
    assert awq["plan_digest"] != rtn["plan_digest"]
    for art in hybrids.values():
        res = cli("verify", art)
        assert res.exit_code == 0 and "OK" in res.stdout, res.stdout


def test_only_the_experts_mapping_changes_the_root(hybrids) -> None:
    """Searched: the routed experts. Attention and the dense MLP are W8A8 as in the plain recipe;
    the MoE input balance also scales the shared expert and folds into the norm and router."""
    awq, rtn = _root(hybrids["awq"]), _root(hybrids["rtn"])
    assert awq.keys() == rtn.keys()
    changed = {k for k in awq if not torch.equal(awq[k], rtn[k])}
    for layer in (0, 1, 2):
        for proj in ATTENTION:
            assert f"model.layers.{layer}.self_attn.{proj}.weight" not in changed
    assert not any(".layers.0.mlp." in k for k in changed)  # the dense layer: not searched
    for layer in (1, 2):
        p = f"model.layers.{layer}"
        assert f"{p}.post_attention_layernorm.weight" in changed
        assert f"{p}.mlp.gate.weight" in changed
        assert f"{p}.mlp.shared_experts.up_proj.weight" in changed
    assert not any(".layers.3." in k for k in changed)  # MTP: round-to-nearest
    layer = "cpu_experts/layer_001.safetensors"
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            _tensors(hybrids["awq"], layer).values(),
            _tensors(hybrids["rtn"], layer).values(),
            strict=True,
        )
    )


def test_routing_is_kept(hybrids) -> None:
    assert_routing_kept(_root(hybrids["awq"]))


def assert_routing_kept(art: dict[str, torch.Tensor]) -> None:
    """The calibrated root's norm and router give the source's logits within the routing bound
    (module docstring), and the router is compensated (changed)."""
    src = SourceCheckpoint.open(TINY)
    eps = src.config.rms_norm_eps
    h = torch.randn(512, src.config.hidden_size, generator=torch.Generator().manual_seed(0))
    h = h.double()
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # [T, D], before the norm weight
    for layer in (1, 2):
        norm, gate = f"model.layers.{layer}.post_attention_layernorm.weight", f"model.layers.{layer}.mlp.gate.weight"  # fmt: skip
        xs, xa = x * src.weight(norm).double(), x * art[norm].double()
        ws, wa = src.weight(gate).double(), art[gate].double()
        assert not torch.equal(wa, ws)  # compensated: W · diag(s)
        bound = (2**-7 + 2**-12) * (xs.abs() @ ws.abs().T)  # [T, E]
        assert bool(((xa @ wa.T - xs @ ws.T).abs() <= bound).all())


@pytest.mark.parametrize("group", [None, 32])
def test_artifact_experts_are_the_calibrated_weights_quantized(
    group: int | None, tmp_path: Path, text: Path
) -> None:
    """The converter writes ``Q(result.apply(W))`` for every expert linear, bit for bit, in the
    layout the option picks; clips are per row (one column) or per group."""
    src = SourceCheckpoint.open(TINY)
    rec = get_recipe("ascend-hybrid")
    if group is not None:
        rec = rec.with_options({"cpu_group_size": group})
    plan = plan_for(src, rec, 1 << 40)
    targets, searched = calibration_targets(plan)
    want_fmt = "int4_cpu" if group is None else "int4_cpu_group"
    assert {q.fmt.name for q in targets.values()} == {"w8a8_dynamic", want_fmt}
    assert searched == {n for n, q in targets.items() if q.fmt.name == want_fmt}
    cal = calibrate_for(src, plan, text, 2, 64, device="cpu")
    convert(src, tmp_path / "out", rec, max_shard_size=1 << 40, calibration=cal)
    q = quantizer_for(want_fmt, {} if group is None else {"group_size": group})
    shrinks = 0
    for layer in (1, 2):
        stacked = _tensors(tmp_path / "out", f"cpu_experts/layer_{layer:03d}.safetensors")
        stacked = {k.rpartition(".")[2]: v for k, v in stacked.items()}
        for e in range(src.config.num_experts):
            got = DEQUANTIZE[group](stacked, e)
            for part, w in zip(("gate", "up", "down"), got, strict=True):
                name = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
                assert torch.equal(w, q(cal.apply(name, src.dequantized(name)))), name
                t = cal.transforms.get(name)
                if t is not None and t.shrink is not None:
                    shrinks += 1
                    k = w.shape[1]
                    assert t.shrink.shape == (w.shape[0], 1 if group is None else k // group)
    assert shrinks > 0


@pytest.mark.parametrize("group", [None, 32])
def test_gptq_codes_are_the_artifacts(group: int | None, tmp_path: Path, text: Path) -> None:
    """``calib_gptq``: every expert linear's GPTQ codes and scales are what the converter
    stores, bit for bit (its round-to-nearest of ``codes · scale``), and they differ from
    round-to-nearest of the AWQ-calibrated weight."""
    src = SourceCheckpoint.open(TINY)
    rec = get_recipe("ascend-hybrid").with_options({"calib_gptq": True})
    if group is not None:
        rec = rec.with_options({"cpu_group_size": group})
    plan = plan_for(src, rec, 1 << 40)
    cal = calibrate_for(src, plan, text, 2, 64, device="cpu")
    assert cal.options.gptq
    convert(src, tmp_path / "out", rec, max_shard_size=1 << 40, calibration=cal)
    moved = 0
    for layer in (1, 2):
        stacked = _tensors(tmp_path / "out", f"cpu_experts/layer_{layer:03d}.safetensors")
        stacked = {k.rpartition(".")[2]: v for k, v in stacked.items()}
        codes = {"gate_up": unpack_nibbles_u8(stacked["gate_up_packed"]).to(torch.int16) - 8,
                 "down": unpack_nibbles_u8(stacked["down_packed"]).to(torch.int16) - 8}  # fmt: skip
        for e in range(src.config.num_experts):
            for part, key, rows in (("gate", "gate_up", slice(0, None, 2)),
                                    ("up", "gate_up", slice(1, None, 2)), ("down", "down", slice(None))):  # fmt: skip
                name = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
                t = cal.transforms[name]
                assert torch.equal(codes[key][e][rows], t.codes.to(torch.int16)), name
                scale = stacked[f"{key}_scale"][e][rows].float().reshape(t.qscale.shape)
                assert torch.equal(scale, t.qscale), name
                awq_only = dataclasses.replace(t, codes=None, qscale=None)
                w = src.dequantized(name)
                moved += int(not torch.equal(cal.apply(name, w), cal.quantizer(name)(
                    apply_transform(w, awq_only, cal.clip_factors))))  # fmt: skip
    assert moved > 0


def test_gptq_sequential_moves_only_down(text: Path) -> None:
    """``AwqOptions.gptq_sequential``: down's Hessian from the GPTQ-quantized gate and up. In the
    first MoE layer (later ones see its changed output) gate and up keep their codes and every
    grid stays (AWQ's scale and clip), down's codes move for some expert; ``gptq`` checks the
    converter's round trip of ``codes · scale`` and raises otherwise."""
    src = SourceCheckpoint.open(TINY)
    targets, searched = calibration_targets(plan_for(src, get_recipe("ascend-hybrid"), 1 << 40))
    tokenizer, eos = load_tokenizer(src.root)
    tokens = token_blocks([text], tokenizer, eos, 2, 64)
    cals = [
        calibrate(src, tokens, AwqOptions(gptq=True, gptq_sequential=seq), targets=targets,
                  searched=searched, device="cpu")
        for seq in (False, True)
    ]  # fmt: skip
    first = min(int(n.split(".")[2]) for n, t in cals[0].transforms.items() if t.codes is not None)
    moved = 0
    for name, t in cals[0].transforms.items():
        if t.codes is None or not name.startswith(f"model.layers.{first}."):
            continue
        u = cals[1].transforms[name]
        assert torch.equal(u.qscale, t.qscale), name  # the grid: AWQ's scale and clip
        if name.endswith("down_proj.weight"):
            moved += int(not torch.equal(u.codes, t.codes))
        else:
            assert torch.equal(u.codes, t.codes), name
    assert moved > 0


def test_group_wise_rtn_converts_verifies_and_runs(cli, tmp_path: Path) -> None:
    out = tmp_path / "g64"
    res = cli("convert", TINY, out, "--recipe", "ascend-hybrid", "--cpu-group-size", "64")
    assert res.exit_code == 0, res.stderr
    manifest = read_json(out / "hetquant.json")
    assert manifest["recipe"]["options"] == {"cpu_group_size": 64}
    assert "calibration" not in manifest
    groups = {g["name"]: g for g in manifest["precision"]["groups"]}
    assert groups["routed_experts"]["format"] == "int4_cpu_group_experts"
    assert groups["routed_experts"]["bits_per_weight"] == 4.25  # + a BF16 scale per 64
    assert cli("verify", out).exit_code == 0
    src = SourceCheckpoint.open(TINY)
    stacked = _tensors(out, "cpu_experts/layer_002.safetensors")
    stacked = {k.rpartition(".")[2]: v for k, v in stacked.items()}
    q = quantizer_for("int4_cpu_group_experts", {"group_size": 64})
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert torch.equal(int4_cpu_group.dequantize_expert(stacked, 5)[2], q(src.dequantized(name)))
    run = cli("run", out, "--tokens", "5,17,42", "--subpools", "2")
    assert run.exit_code == 0, run.stderr


# ---- refusals: exit 2, one line, nothing written ------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "opts", "needles"),
    [
        ("ascend-hybrid", ("--cpu-group-size", "48"), ("cpu_group_size=48", "32, 64, 128")),
        ("ascend-hybrid", ("--cpu-group-size", "0"), ("cpu_group_size=0",)),
        ("awq-w4a16", ("--cpu-group-size", "32"), ("no option 'cpu_group_size'",)),
        ("awq-w4a16", ("--calib-gptq",), ("no option 'calib_gptq'",)),
        ("ascend-hybrid", ("--calib-gptq",), ("--calib-gptq", "--calib-data")),
    ],
)
def test_option_values_the_format_cannot_take(
    cli, tiny_src: Path, tmp_path: Path, recipe: str, opts: tuple, needles: tuple
) -> None:
    before = tree_hashes(tiny_src)
    res = cli("convert", tiny_src, tmp_path / "out", "--recipe", recipe, *opts)
    assert_refused(res, tiny_src, tmp_path / "out", before, *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("opts", "needles"),
    [
        (("--cpu-group-size", "64"), ("ct_pack_quantized", "--cpu-group-size", "drop it")),
        (("--calib-data", "TEXT", *CALIB), ("repacked losslessly", "--calib-data")),
    ],
    ids=["group-size", "calib-data"],
)
def test_lossless_k2_thinking_experts_are_not_requantized(
    cli, tmp_path: Path, text: Path, opts: tuple, needles: tuple
) -> None:
    src = make_kimi_k2(tmp_path / "src", "thinking")
    before = tree_hashes(src)
    opts = tuple(text if o == "TEXT" else o for o in opts)
    res = cli("convert", src, tmp_path / "out", "--recipe", "ascend-hybrid", *opts)
    assert_refused(res, src, tmp_path / "out", before, *needles)
    assert not (tmp_path / "out").exists()
