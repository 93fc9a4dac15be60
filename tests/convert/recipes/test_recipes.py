"""Every recipe on the tiny model: verifies, is deterministic, stays within each format's bound
of the source, describes exactly what it stores, and assigns the formats the recipe table says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import TINY, tree_hashes

from hetquant.convert import SourceCheckpoint, convert, get_recipe, replay_plan, verify_artifact
from hetquant.convert.engine.manifest import MANIFEST_NAME
from hetquant.formats.families import load_json
from hetquant.formats.int4_cpu import dequantize_expert
from hetquant.formats.nvfp4 import BLOCK
from hetquant.formats.nvfp4_ascend import to_canonical

RECIPES = [
    "bf16",
    "ascend-hybrid",
    "ascend-w8a8",
    "awq-w4a16",
    "fp4",
    "ascend-w4a8",
    "ascend-w4a16",
]
VARIANTS = {
    "awq-g64": ("awq-w4a16", {"group_size": 64}),
    "fp4-nvfp4": ("fp4", {"fp4_layout": "nvfp4"}),
}
# float32 rounding of q·s: with |q| <= 127 it adds at most 127·s·2^-24 < (s/2)·2^-15 (ties sit exactly
# on the bound), relative slack 2^-15; 4-bit and E2M1 codes are smaller still.
REL = 2.0**-15


def _convert(name: str, options: dict, out: Path) -> Path:
    recipe = get_recipe(name).with_options(options) if options else get_recipe(name)
    convert(SourceCheckpoint.open(TINY), out, recipe, max_shard_size=1 << 40)
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("recipes")
    cases = {r: (r, {}) for r in RECIPES} | VARIANTS
    return {key: _convert(name, opts, base / key) for key, (name, opts) in cases.items()}


@pytest.fixture(scope="module")
def source() -> SourceCheckpoint:
    return SourceCheckpoint.open(TINY)


def _load(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.rglob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _src_bf16(source: SourceCheckpoint, name: str) -> torch.Tensor:
    t = source.tensors[name]
    if t.fmt_name != "fp8_block":
        return source.weight(name).float()
    parts = source.stored(name)  # the format's own reference dequantization, whole-tensor
    return t.fmt.dequantize_bf16(parts["weight"], parts["weight_scale_inv"]).float()


def _bound(fmt: str, stored: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """Per-element error bound of ``fmt`` for these stored tensors, broadcast to ``shape``."""
    n, k = shape
    if fmt == "bf16":
        return torch.zeros(shape)
    if fmt in ("w8a8_dynamic", "int4_cpu", "w4a8_dynamic"):
        return (stored["weight_scale"].reshape(n, 1) / 2).expand(n, k)
    if fmt == "ct_pack_quantized":
        g = k // stored["weight_scale"].shape[1]
        return (stored["weight_scale"].float() / 2).repeat_interleave(g, 1)  # (N, K)
    if fmt == "awq_w4a16":
        g = k // stored["scales"].shape[0]
        return (stored["scales"].float().t() / 2).repeat_interleave(g, 1)  # (N, K)
    if fmt in ("nvfp4", "nvfp4_ascend"):
        canon = to_canonical(stored) if fmt == "nvfp4_ascend" else stored
        eff = canon["weight_scale"].float() * canon["weight_scale_2"].float()  # (N, K/16)
        return eff.repeat_interleave(BLOCK, 1)  # half the widest E2M1 gap (4 → 6) is one step
    raise AssertionError(f"no bound for {fmt}")


@pytest.mark.parametrize("key", [*RECIPES, *VARIANTS])
def test_artifact_verifies(artifacts: dict[str, Path], key: str) -> None:
    assert verify_artifact(artifacts[key]) == []


@pytest.mark.parametrize("key", ["ascend-hybrid", "awq-w4a16", "fp4"])
def test_deterministic(artifacts: dict[str, Path], key: str, tmp_path: Path) -> None:
    name, opts = VARIANTS.get(key, (key, {}))
    again = _convert(name, opts, tmp_path / "again")
    assert tree_hashes(again) == tree_hashes(artifacts[key])


@pytest.mark.parametrize("key", [*RECIPES, *VARIANTS])
def test_every_tensor_within_its_format_bound(
    artifacts: dict[str, Path], source: SourceCheckpoint, key: str
) -> None:
    root = artifacts[key]
    plan = replay_plan(root, load_json(root / MANIFEST_NAME))
    stored = _load(root)
    checked = 0
    for job in plan.jobs:
        if job.kind == "copy":
            assert torch.equal(
                stored[job.source].view(torch.uint8), source.weight(job.source).view(torch.uint8)
            )
        elif job.kind == "linear":
            prefix = job.source.removesuffix("weight")
            mine = {p.key: stored[p.tensor] for p in job.outputs}
            fmt = job.target.fmt
            ref = _src_bf16(source, job.source)
            err = (fmt.dequantize(mine) - ref).abs()
            assert bool(
                (err <= _bound(job.target.name, mine, ref.shape) * (1 + REL) + 1e-30).all()
            ), prefix
        else:  # stacked routed experts
            layer = {p.key: stored[p.tensor] for p in job.outputs}
            e = int(re.search(r"experts\.(\d+)\.", job.source).group(1))
            for got, name in zip(dequantize_expert(layer, e), job.sources, strict=True):
                ref = _src_bf16(source, name)
                rows = (
                    slice(0, None, 2) if "gate_proj" in name else slice(1, None, 2)
                )  # interleaved
                scale = (
                    layer["down_scale"][e]
                    if "down_proj" in name
                    else layer["gate_up_scale"][e][rows]
                )
                assert bool(((got - ref).abs() <= (scale[:, None] / 2) * (1 + REL)).all()), name
        checked += 1
    assert checked == len(plan.jobs) > 0


def _piece_bytes(stored: dict[str, torch.Tensor], piece) -> torch.Tensor:
    flat = stored[piece.tensor].reshape(-1).view(torch.uint8)
    return flat[piece.offset : piece.offset + piece.meta.nbytes]


@pytest.mark.parametrize("key", [k for k in [*RECIPES, *VARIANTS] if k != "bf16"])
def test_streamed_jobs_store_exactly_the_whole_tensor_quantization(
    artifacts: dict[str, Path], source: SourceCheckpoint, key: str
) -> None:
    """The converter streams block rows (absmax from FP8 codes, experts row by row, chunks packed
    straight into their final layout); the bytes must equal quantizing the whole weight at once
    (with the joint absmax of its merged module where the plan groups one)."""
    root = artifacts[key]
    plan = replay_plan(root, load_json(root / MANIFEST_NAME))
    stored = _load(root)
    for job in (j for j in plan.jobs if j.kind != "copy"):
        refs = [_src_bf16(source, name).to(torch.bfloat16) for name in job.sources]
        if job.kind == "linear":
            fmt = job.target.fmt
            # a merged module's members share the per-tensor scale of their joint absmax
            group = [_src_bf16(source, n).abs().amax() for n in job.amax_group]
            opts = {"weight_amax": float(max(group))} if group else {}
            whole = fmt.quantize(refs[0], **opts)
        else:
            whole = job.target.fmt.quantize_expert(*refs)
        for piece in job.outputs:
            want = whole[piece.key].contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(_piece_bytes(stored, piece), want), (job.source, piece.key)


@pytest.mark.parametrize("key", ["ascend-hybrid", "ascend-w8a8"])
def test_ascend_description_covers_exactly_the_root(artifacts: dict[str, Path], key: str) -> None:
    root = artifacts[key]
    desc = load_json(root / "quant_model_description.json")
    header = ["version", "model_quant_type", "metadata", "group_size", "optional"]
    assert list(desc)[-len(header) :] == header  # after the entries, as msModelSlim writes them
    assert desc["metadata"] == desc["optional"] == {}
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"
    index = load_json(root / "model.safetensors.index.json")["weight_map"]
    assert set(desc) - set(header) == set(index)
    for name, qt in desc.items():
        if name in header:
            continue
        quantized = re.search(
            r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|gate_proj|up_proj|down_proj)\.", name
        )
        assert qt == ("W8A8_DYNAMIC" if quantized else "FLOAT"), name
    assert "quantization_config" not in load_json(root / "config.json")


def test_hybrid_routed_experts_only_in_cpu_part(artifacts: dict[str, Path]) -> None:
    root = artifacts["ascend-hybrid"]
    index = load_json(root / "model.safetensors.index.json")["weight_map"]
    assert not [n for n in index if ".mlp.experts." in n]
    layers = sorted(p.name for p in (root / "cpu_experts").iterdir())
    assert layers == ["layer_001.safetensors", "layer_002.safetensors", "layer_003.safetensors"]
    manifest = load_json(root / MANIFEST_NAME)
    assert manifest["parts"]["cpu_experts"]["files"] == [f"cpu_experts/{n}" for n in layers]


def test_awq_and_fp4_configs(artifacts: dict[str, Path]) -> None:
    awq = load_json(artifacts["awq-g64"] / "config.json")["quantization_config"]
    assert (awq["quant_method"], awq["group_size"], awq["version"]) == ("awq", 64, "gemm")
    # full names: a bare "gate" would also match every gate_proj (substring matching)
    assert "gate" not in awq["modules_to_not_convert"]
    assert set(awq["modules_to_not_convert"]) >= {"lm_head", "model.layers.1.mlp.gate"}
    tiled = load_json(artifacts["fp4"] / "config.json")["quantization_config"]
    assert (tiled["quant_method"], tiled["format"]) == ("hetquant", "nvfp4_ascend")
    assert not (artifacts["fp4"] / "hf_quant_config.json").exists()
    hf = load_json(artifacts["fp4-nvfp4"] / "hf_quant_config.json")
    assert hf["quantization"]["group_size"] == BLOCK
    assert "model.layers.0.self_attn.kv_b_proj" in hf["quantization"]["exclude_modules"]


def test_mtp_drop(tmp_path: Path) -> None:
    root = _convert("ascend-w8a8", {"mtp": "drop"}, tmp_path / "a")
    assert verify_artifact(root) == []
    assert load_json(root / "config.json")["num_nextn_predict_layers"] == 0
    names = load_json(root / "model.safetensors.index.json")["weight_map"]
    assert not [n for n in names if n.startswith("model.layers.3.")]
    mtp = {g["name"]: g for g in load_json(root / MANIFEST_NAME)["precision"]["groups"]}["mtp"]
    assert (mtp["format"], mtp["bytes"]) == ("dropped", 0)


# Which role got which format, per recipe (source dtypes: FP8 linears, BF16 norms/embeddings/
# router/eh_proj, F32 router bias).
GOLDEN = {
    "bf16": {"attention": "bf16", "kv_b": "bf16", "dense": "bf16", "shared": "bf16", "routed": "bf16", "router": "copy", "eh_proj": "copy"},
    "ascend-hybrid": {"attention": "w8a8_dynamic", "kv_b": "bf16", "dense": "w8a8_dynamic", "shared": "w8a8_dynamic", "routed": "int4_cpu_experts", "router": "copy", "eh_proj": "copy"},
    "ascend-w8a8": {"attention": "w8a8_dynamic", "kv_b": "bf16", "dense": "w8a8_dynamic", "shared": "w8a8_dynamic", "routed": "w8a8_dynamic", "router": "copy", "eh_proj": "copy"},
    "awq-w4a16": {"attention": "awq_w4a16", "kv_b": "awq_w4a16", "dense": "awq_w4a16", "shared": "awq_w4a16", "routed": "awq_w4a16", "router": "copy", "eh_proj": "copy"},
    "fp4": {"attention": "bf16", "kv_b": "bf16", "dense": "nvfp4_ascend", "shared": "nvfp4_ascend", "routed": "nvfp4_ascend", "router": "copy", "eh_proj": "copy"},
    "ascend-w4a8": {"attention": "w8a8_dynamic", "kv_b": "bf16", "dense": "w8a8_dynamic", "shared": "w8a8_dynamic", "routed": "w4a8_dynamic", "mtp_routed": "w8a8_dynamic", "router": "copy", "eh_proj": "copy"},
    "ascend-w4a16": {"attention": "w8a8_dynamic", "kv_b": "bf16", "dense": "w8a8_dynamic", "shared": "w8a8_dynamic", "routed": "ct_pack_quantized", "router": "copy", "eh_proj": "copy"},
}  # fmt: skip
PROBES = {
    "attention": ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"],
    "kv_b": ["self_attn.kv_b_proj"],
    "dense": ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
    "shared": ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"],
    "routed": ["mlp.experts.0.gate_proj", "mlp.experts.7.down_proj"],
    "router": ["mlp.gate"],
    "eh_proj": ["eh_proj"],
}  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES)
def test_golden_format_listing(recipe: str, source: SourceCheckpoint) -> None:
    from hetquant.convert import plan_for

    plan = plan_for(source, get_recipe(recipe), 1 << 40)
    fmt_of = {
        src: ("copy" if j.kind == "copy" else j.target.name) for j in plan.jobs for src in j.sources
    }
    layers = {"dense": [0], "eh_proj": [3]}
    for cls, probes in PROBES.items():
        for layer in layers.get(cls, [1, 3]):  # a MoE layer and the MTP layer (kept)
            for probe in probes:
                name = f"model.layers.{layer}.{probe}.weight"
                want = GOLDEN[recipe].get(f"mtp_{cls}" if layer == 3 else cls, GOLDEN[recipe][cls])
                assert fmt_of[name] == want, (recipe, name)
