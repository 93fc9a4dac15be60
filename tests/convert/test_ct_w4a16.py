"""Recipe ct-w4a16 (issue #14 item 3): compressed-tensors pack-quantized W4A16 routed experts
that compressed-tensors' own code and vllm-ascend's config lookup take as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor  # the test extra
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_named_modules
from safetensors.torch import load_file
from support import REPO, TINY, TOOLS, make_kimi_k2, read_json
from torch import nn

from hetquant.convert import SourceCheckpoint, convert, get_recipe
from hetquant.formats import get_format

CALIB = ["--calib-data", str(TOOLS / "calib.txt"), "--calib-samples", "4", "--calib-seq-len", "64"]
KEYS = ("weight_packed", "weight_scale", "weight_shape")
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj")


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(root.glob("model-*.safetensors")) for k, v in load_file(f).items()}


def _packed(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n.removesuffix(".weight_packed") for n in tensors if n.endswith("_packed"))


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from click.testing import CliRunner

    from hetquant.convert.cli import main

    base = tmp_path_factory.mktemp("ct")
    cases = {"rtn": [], "g128": ["--group-size", "128"], "awq": CALIB, "bf16": None}
    out = {}
    for key, extra in cases.items():
        recipe = ["--recipe", "bf16"] if extra is None else ["--recipe", "ct-w4a16", *extra]
        res = CliRunner().invoke(main, ["convert", str(TINY), str(base / key), *recipe])
        assert res.exit_code == 0, res.output
        out[key] = base / key
    return out


@pytest.mark.parametrize("key", ["rtn", "g128", "awq"])
def test_only_routed_experts_are_packed(arts: dict[str, Path], key: str) -> None:
    tensors = _tensors(arts[key])
    packed = _packed(tensors)
    assert packed and all(EXPERT.fullmatch(m) for m in packed)
    assert len(packed) == 3 * 8 * 3  # 2 MoE layers + the MTP layer, 8 experts, 3 linears
    qc = read_json(arts[key] / "config.json")["quantization_config"]
    group = 128 if key == "g128" else 32
    assert qc["group_size"] == qc["config_groups"]["group_0"]["weights"]["group_size"] == group
    assert tensors[f"{packed[0]}.weight_scale"].shape[1] == 256 // group


@pytest.mark.parametrize("key", ["rtn", "g128", "awq"])
def test_compressed_tensors_decompresses_our_weights_exactly(
    arts: dict[str, Path], key: str
) -> None:
    """compressed-tensors' PackedQuantizationCompressor (0.20.0) on our stored tensors gives our
    dequantization: bf16(q · s) with the BF16 scales as stored, q · s exactly with them in F32."""
    qc = QuantizationConfig.model_validate(
        read_json(arts[key] / "config.json")["quantization_config"]
    )
    scheme = qc.config_groups["group_0"]
    assert (qc.format, scheme.weights.symmetric, scheme.weights.strategy) == (
        "pack-quantized", True, "group"
    )  # fmt: skip
    tensors = _tensors(arts[key])
    fmt = get_format("ct_pack_quantized", group_size=scheme.weights.group_size)
    for m in _packed(tensors):
        stored = {k: tensors[f"{m}.{k}"] for k in KEYS}
        ours = fmt.dequantize(stored)  # float32, exact
        theirs = PackedQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs, ours.to(torch.bfloat16)), m
        wide = dict(stored, weight_scale=stored["weight_scale"].float())
        assert torch.equal(PackedQuantizationCompressor.decompress(wide, scheme)["weight"], ours)


def _hf_tree(names: list[str]) -> nn.Module:
    """Modules of the artifact's names as DeepSeek's HF modeling code makes them: nn.Linear for
    every linear and the heads, nn.Embedding for embeddings, its own class for the router."""
    root = nn.Module()
    for name in names:
        parent = root
        *path, leaf = name.split(".")
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        if name.endswith("embed_tokens"):
            parent.add_module(leaf, nn.Embedding(1, 1))
        else:
            parent.add_module(leaf, nn.Module() if name.endswith("mlp.gate") else nn.Linear(1, 1))
    return root


def test_compressed_tensors_matches_exactly_the_packed_modules(arts: dict[str, Path]) -> None:
    qc = read_json(arts["rtn"] / "config.json")["quantization_config"]
    tensors = _tensors(arts["rtn"])
    modules = sorted({n.rpartition(".")[0] for n in tensors if n.count(".") > 1})
    group = qc["config_groups"]["group_0"]
    model = _hf_tree([m for m in modules if not m.endswith(("norm", "layernorm"))])
    matched = [n for n, _ in match_named_modules(model, group["targets"], qc["ignore"])]
    assert sorted(matched) == _packed(tensors)


# -- vllm-ascend 0.23.0.post1's lookup, ported (the code is ours; file:line cited) --------------
# vLLM 0.23.0 model_executor/layers/quantization/compressed_tensors/utils.py
def _match(value: str, target: str, contains: bool = False) -> bool:  # :175-193
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target.lower() in value.lower() if contains else target == value


def _should_ignore(name: str, ignore: list[str], fused: dict[str, list[str]]) -> bool:  # :50-102
    proj = name.split(".")[-1]
    if proj in fused and name not in ignore:
        shards = {any(_match(name.replace(proj, s), t) for t in ignore) for s in fused[proj]}
        if len(shards) > 1:
            raise ValueError(f"different schemes for the shards of {name}")
        return shards.pop()
    return any(_match(name, t) for t in ignore)


def _find_target(name: str, cls: str, targets, fused) -> str | None:  # :113-152, :196-240
    hit = next((t for t in targets if _match(name, t)), None)
    hit = hit or next((t for t in targets if _match(cls, t, contains=True)), None)
    key = next((k for k in fused if name.endswith(k)), None)
    if hit is None and key is not None:
        parts = [next((t for t in targets if _match(name.replace(key, u), t)), None)
                 for u in fused[key]]  # fmt: skip
        hit = parts[0] if all(parts) else None
    return hit


def _vllm_ascend_scheme(qc: dict, name: str, cls: str, moe: bool) -> str | None:
    """vllm-ascend ``AscendCompressedTensorsConfig`` (quantization/compressed_tensors_config.py):
    a FusedMoE layer is looked up as ``<prefix>.0.gate_proj`` (:181) with a ``Linear`` target
    also serving ``FusedMoE`` (:97-106); ignored → None (unquantized, :265-266); a matched target's
    weights decide the type (:313-378); W4A16 has a MoE scheme only (w4a16.py:111)."""
    fused = {"gate_up_proj": ["gate_proj", "up_proj"],  # models/deepseek_v2.py packed modules
             "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}  # fmt: skip
    groups = qc["config_groups"].values()
    schemes = {t: g for g in groups for t in g["targets"]}
    if "Linear" in schemes and "FusedMoE" not in schemes:
        schemes["FusedMoE"] = schemes["Linear"]
    name = name + ".0.gate_proj" if moe else name
    if _should_ignore(name, qc.get("ignore", []), fused):
        return None
    w = schemes[_find_target(name, cls, schemes, fused)]["weights"]  # None: KeyError, as there
    is_w4a16 = w["type"] == "int" and w["num_bits"] == 4 and w["strategy"] == "group"
    if not (is_w4a16 and not w["dynamic"]) or not moe:
        raise NotImplementedError(f"no compressed-tensors scheme for {name} ({cls})")
    return "W4A16"


def _vllm_layers(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, bool]]:
    """(prefix, class, is MoE) of every quantizable layer vLLM's DeepseekV2 builds."""
    out = set()
    for n in tensors:
        m = n.rpartition(".")[0]
        if hit := re.fullmatch(r"(.+\.mlp\.experts)\.\d+\.\w+", m):
            out.add((hit.group(1), "SharedFusedMoE", True))
        elif m.endswith(("gate_proj", "up_proj")):
            out.add((m.rsplit(".", 1)[0] + ".gate_up_proj", "MergedColumnParallelLinear", False))
        elif m.endswith(("q_a_proj", "kv_a_proj_with_mqa")):
            out.add(
                (m.rsplit(".", 1)[0] + ".fused_qkv_a_proj", "MergedColumnParallelLinear", False)
            )
        elif m.endswith(("q_b_proj", "kv_b_proj", "o_proj", "down_proj")):
            out.add((m, "ColumnParallelLinear", False))
        elif m.endswith("mlp.gate"):  # vLLM 0.23 builds it without a quant config (GateLinear,
            out.add((m, "ReplicatedLinear", False))  # router/gate_linear.py:64); if asked: ignored
    return sorted(out)


@pytest.mark.parametrize("key", ["rtn", "g128"])
def test_vllm_ascend_takes_the_config_as_written(arts: dict[str, Path], key: str) -> None:
    qc = read_json(arts[key] / "config.json")["quantization_config"]
    tensors = _tensors(arts[key])
    layers = _vllm_layers(tensors)
    got = {name: _vllm_ascend_scheme(qc, name, cls, moe) for name, cls, moe in layers}
    moe = [n for n, _, is_moe in layers if is_moe]
    assert len(moe) == 3 and all(got[n] == "W4A16" for n in moe)
    assert all(got[n] is None for n, _, is_moe in layers if not is_moe)
    # AscendW4A16FusedMoEMethod: group from the config (default 32, w4a16.py:185); per-expert
    # w13 / w2 scales [2I, H/g] / [H, I/g] (:231-236) must hold our stored [I, H/g] / [H, I/g]
    g = qc.get("group_size", 32)
    e0 = moe[0] + ".0."
    assert tensors[e0 + "gate_proj.weight_scale"].shape == (256, 256 // g)
    assert tensors[e0 + "down_proj.weight_scale"].shape == (256, 256 // g)


def test_the_port_refuses_what_vllm_ascend_refuses(arts: dict[str, Path]) -> None:
    """Without the attention modules in ``ignore`` the lookup fails as vllm-ascend's does."""
    qc = read_json(arts["rtn"] / "config.json")["quantization_config"]
    qc = {**qc, "ignore": [i for i in qc["ignore"] if "self_attn" not in i]}
    with pytest.raises(NotImplementedError, match="o_proj"):
        _vllm_ascend_scheme(qc, "model.layers.0.self_attn.o_proj", "RowParallelLinear", False)


def test_calibrated_touches_only_what_feeds_the_experts(arts: dict[str, Path]) -> None:
    """AWQ searched with the symmetric quantizer, on the routed experts only: attention weights
    (no quantized linear in their balances) stay exactly the bf16 recipe's; the experts and the
    MLP input norm (the experts' balance) change."""
    manifest = read_json(arts["awq"] / "hetquant.json")
    opts = manifest["calibration"]["options"]
    assert (opts["quantizer"], opts["group_size"]) == ("ct_pack_quantized", 32)
    awq, rtn, bf16 = (_tensors(arts[k]) for k in ("awq", "rtn", "bf16"))
    attn = [n for n in bf16 if ".self_attn." in n and n.endswith(".weight")]
    assert attn and all(torch.equal(awq[n], bf16[n]) for n in attn)
    e = "model.layers.1.mlp.experts.0.up_proj.weight_packed"
    assert not torch.equal(awq[e], rtn[e])
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert not torch.equal(awq[norm], bf16[norm])


def test_read_back_as_a_source(arts: dict[str, Path], tmp_path: Path) -> None:
    """hetquant reads its own CT output (config and tensors) as a compressed-tensors source."""
    src = SourceCheckpoint.open(arts["rtn"])
    out = tmp_path / "back"
    convert(src, out, get_recipe("bf16"), max_shard_size=1 << 40)
    back, tensors = _tensors(out), _tensors(arts["rtn"])
    fmt = get_format("ct_pack_quantized", group_size=32)
    m = "model.layers.2.mlp.experts.5.down_proj"
    want = fmt.dequantize({k: tensors[f"{m}.{k}"] for k in KEYS}).to(torch.bfloat16)
    assert torch.equal(back[f"{m}.weight"], want)


@pytest.mark.parametrize("group", ["64", "16"])
def test_group_size_it_cannot_take(cli, tmp_path: Path, group: str) -> None:
    res = cli("convert", TINY, tmp_path / "o", "--recipe", "ct-w4a16", "--group-size", group)
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
    assert f"group_size={group}" in res.stderr and "one of 32, 128" in res.stderr
    assert not (tmp_path / "o").exists()


def test_shapes_that_do_not_pack(cli, tmp_path: Path) -> None:
    """Expert intermediate 48: down_proj's 48 inputs hold no whole group of 32."""
    import runpy

    gen = runpy.run_path(str(REPO / "examples" / "tiny-qwen3-moe" / "make_tiny.py"))
    src = gen["write_checkpoint"](
        tmp_path / "q3", "bf16", {**gen["CONFIG"], "moe_intermediate_size": 48}
    )
    res = cli("convert", src, tmp_path / "o", "--recipe", "ct-w4a16")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "mlp.experts.0.down_proj.weight" in res.stderr and "32 or 128" in res.stderr
    assert not (tmp_path / "o").exists()


def test_kimi_k2_thinking_experts_kept_as_stored(tmp_path: Path) -> None:
    """K2 Thinking's experts are already this format (group 32, I32 weight_shape): the artifact
    keeps them byte for byte and writes a config vllm-ascend takes without editing targets."""
    k2t = make_kimi_k2(tmp_path / "k2t", "thinking")
    out = tmp_path / "out"
    convert(SourceCheckpoint.open(k2t), out, get_recipe("ct-w4a16"), max_shard_size=1 << 40)
    src, got = _tensors(k2t), _tensors(out)
    experts = [n for n in src if ".mlp.experts." in n]
    assert experts and all(
        got[n].dtype == src[n].dtype and torch.equal(got[n], src[n]) for n in experts
    )
    qc = read_json(out / "config.json")["quantization_config"]
    schemes = {n: _vllm_ascend_scheme(qc, n, c, moe) for n, c, moe in _vllm_layers(got)}
    assert {v for n, v in schemes.items() if n.endswith(".experts")} == {"W4A16"}
    assert {v for n, v in schemes.items() if not n.endswith(".experts")} == {None}


def test_ignore_names_the_merged_modules_engines_build(tiny_qwen3, tmp_path: Path) -> None:
    """vLLM matches a merged layer (``qkv_proj``, ``gate_up_proj``) by its own name first, and
    0.32 builds Qwen3-MoE's dense ``gate_up_proj`` without it in the config's packed mapping:
    ``ignore`` lists the merged names whose every part is kept (checked with vLLM's own matcher
    in ``tests/runtime/vllm/test_vllm_serves.py``)."""
    out = tmp_path / "out"
    src = SourceCheckpoint.open(tiny_qwen3["fp8"])
    convert(src, out, get_recipe("ct-w4a16"), max_shard_size=1 << 40)
    ignore = read_json(out / "config.json")["quantization_config"]["ignore"]
    dense = src.config.raw["mlp_only_layers"]
    assert dense and all(f"model.layers.{i}.mlp.gate_up_proj" in ignore for i in dense)
    layers = range(src.config.raw["num_hidden_layers"])
    assert all(f"model.layers.{i}.self_attn.qkv_proj" in ignore for i in layers)
    assert not any(".experts." in n for n in ignore)  # the quantized ones stay matched
