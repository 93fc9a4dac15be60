"""Kimi K2 Thinking as a source: its compressed-tensors quantization_config is read, every scheme
or tensor hetquant does not read is refused (exit 2 naming the tensor and the scheme, nothing
written), and a 4-bit source is not re-quantized into another 4-bit format unless asked."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import INDEX, make_kimi_k2, read_json, resave_shard, shard_of, st_bytes, write_json

from hetquant.convert import SourceCheckpoint, SourceItem, get_recipe, make_plan
from hetquant.formats import get_format

EXPERT = "model.layers.1.mlp.experts.4.down_proj"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_kimi_k2(tmp_path_factory.mktemp("k2t") / "Kimi-K2-Thinking", "thinking")


@pytest.fixture
def src(thinking: Path, tmp_path: Path) -> Path:
    """A private copy (tests corrupt it)."""
    return Path(shutil.copytree(thinking, tmp_path / "src"))


def _weights(src: Path, edit: Callable[[dict], None]) -> None:
    cfg = read_json(src / "config.json")
    edit(cfg["quantization_config"]["config_groups"]["group_0"]["weights"])
    write_json(src / "config.json", cfg)


def _refused(cli, src: Path, out: Path, *want: str, recipe: str = "bf16") -> None:
    res = cli("convert", src, out, "--recipe", recipe)
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for w in want:
        assert w in res.stderr, res.stderr
    assert not out.exists()  # nothing written


def test_thinking_source_reads_its_config(thinking: Path) -> None:
    s = SourceCheckpoint.open(thinking)
    routed = {t.fmt for n, t in s.tensors.items() if ".mlp.experts." in n}
    assert routed == {get_format("ct_pack_quantized", group_size=32, shape_dtype="I32")}
    assert {t.fmt_name for n, t in s.tensors.items() if ".mlp.experts." not in n} == {
        "bf16",
        "plain",
    }


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda w: w.update(symmetric=False), "asymmetric weights (zero points)"),
        (lambda w: w.update(actorder="group"), "activation ordering (actorder 'group')"),
        (lambda w: w.update(group_size=48), "group_size 48 does not divide the"),
        (lambda w: w.update(num_bits=8), "int8 weights are not read"),
        (lambda w: w.update(strategy="channel"), "strategy 'channel' is not read"),
        (lambda w: w.update(type="float"), "float4 weights are not read"),
    ],
    ids=["zero-points", "actorder", "group-not-dividing-k", "8-bit", "channel", "float"],
)
def test_schemes_not_read_are_refused(cli, src: Path, tmp_path: Path, edit, why: str) -> None:
    _weights(src, edit)
    _refused(cli, src, tmp_path / "out", "model.layers.1.mlp.experts.0.gate_proj", why,
             "compressed-tensors group_0")  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda g: g.update(format="int-quantized"), "format 'int-quantized' is not read"),
        (lambda g: g.update(input_activations={"num_bits": 8}), "activation quantization"),
    ],
    ids=["int-quantized", "w4a8"],
)
def test_group_formats_not_read_are_refused(cli, src, tmp_path: Path, edit, why: str) -> None:
    cfg = read_json(src / "config.json")
    edit(cfg["quantization_config"]["config_groups"]["group_0"])
    write_json(src / "config.json", cfg)
    _refused(cli, src, tmp_path / "out", "experts.0.gate_proj", why)


@pytest.mark.parametrize(
    ("key", "what"),
    [("weight_zero_point", "zero points"), ("weight_g_idx", "activation ordering")],
)
def test_stored_zero_points_or_g_idx_are_refused(cli, src, tmp_path: Path, key, what) -> None:
    """Whatever the config says, such tensors mean a scheme hetquant does not read."""
    shard = shard_of(src, f"{EXPERT}.weight_packed")
    resave_shard(
        shard, lambda t: t.__setitem__(f"{EXPERT}.{key}", torch.zeros(4, dtype=torch.int32))
    )
    index = read_json(src / INDEX)
    index["weight_map"][f"{EXPERT}.{key}"] = shard.name
    write_json(src / INDEX, index)
    _refused(cli, src, tmp_path / "out", f"{EXPERT}.{key}", what)


def test_config_group_must_match_the_stored_group(cli, src: Path, tmp_path: Path) -> None:
    _weights(src, lambda w: w.update(group_size=64))
    _refused(cli, src, tmp_path / "out", "stored pack-quantized with group 32", "group_size 64")


def test_format_neutral_actorder_is_read(cli, src: Path, tmp_path: Path) -> None:
    """actorder 'weight' reorders only during calibration (compressed-tensors: 'doesn't change
    the quantization format')."""
    _weights(src, lambda w: w.update(actorder="weight"))
    assert cli("convert", src, tmp_path / "out", "--recipe", "bf16").exit_code == 0


@pytest.mark.parametrize("recipe", ["awq-w4a16", "fp4"])
def test_requantizing_4bit_experts_needs_asking(
    cli, thinking: Path, tmp_path: Path, recipe
) -> None:
    _refused(cli, thinking, tmp_path / "out", "expert_gate (layer 1 expert 0)",
             "ct_pack_quantized", "losing accuracy twice", "--requantize", recipe=recipe)  # fmt: skip
    res = cli("convert", thinking, tmp_path / "ok", "--recipe", recipe, "--requantize")
    assert res.exit_code == 0, res.stderr
    assert read_json(tmp_path / "ok" / "hetquant.json")["recipe"]["options"] == {"requantize": True}


def test_w8a8_from_4bit_is_no_requantization(cli, thinking: Path, tmp_path: Path) -> None:
    """8-bit targets hold the 4-bit grid's values far more finely: not refused."""
    assert cli("convert", thinking, tmp_path / "out", "--recipe", "ascend-w8a8").exit_code == 0


def test_bf16_from_thinking_is_exact(cli, thinking: Path, tmp_path: Path) -> None:
    res = cli("convert", thinking, tmp_path / "out", "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    s = SourceCheckpoint.open(thinking)
    stored = s.stored(f"{EXPERT}.weight")
    q = torch.stack(
        [(stored["weight_packed"] >> (4 * i)) & 0xF for i in range(8)], -1
    )  # (N, K/8, 8)
    q = q.reshape(q.shape[0], -1).float() - 8  # (N, K)
    want = (q * stored["weight_scale"].float().repeat_interleave(32, 1)).to(torch.bfloat16)
    out = tmp_path / "out"
    name = f"{EXPERT}.weight"
    got = st_bytes(out / read_json(out / INDEX)["weight_map"][name], name)
    assert got == want.view(torch.int16).numpy().tobytes()


def test_hybrid_repack_takes_the_source_group(thinking: Path) -> None:
    """The CPU group format's group is the source variant's (plan only: 32 here, 64 supposed)."""
    src = SourceCheckpoint.open(thinking)
    items = [SourceItem(t.name, t.role, t.dtype, t.fmt_name, t.fmt_params)
             for t in src.tensors.values()]  # fmt: skip
    cfg = src.config
    for group in (32, 64):
        given = [dataclasses.replace(i, params=(("group_size", group),)) if i.params else i
                 for i in items]  # fmt: skip
        plan = make_plan(given, get_recipe("ascend-hybrid"), 1 << 40)
        scale = plan.file_of()["model.layers.1.mlp.experts.gate_up_scale"]
        meta = {t.name: t.meta for t in scale.tensors}["model.layers.1.mlp.experts.gate_up_scale"]
        want = (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size // group)
        assert (meta.dtype, meta.shape) == ("BF16", want)
        assert {j.target.name for j in plan.jobs if j.kind == "experts"} == {
            "int4_cpu_group_experts"
        }
