"""ParallelLayout (stages, expert ownership, validation) and the shard rules, without artifacts.

Format-level check: for every weight format, each TP rank's pieces (shard_pieces: the format's
shard_view / shard_axes / shard_fixup) dequantize to exactly that rank's rows or columns of the
whole weight, for every degree the format's units allow; every other degree is refused. The units
are written out here independently of the formats' code.
"""

from __future__ import annotations

import math

import pytest
import torch

from hetquant.formats import HetquantError, get_format
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.nvfp4_ascend import tiled_slice
from hetquant.formats.safetensors_io import HeaderEntry
from hetquant.runtime import ParallelLayout
from hetquant.runtime.parallel.layout import pp_partition
from hetquant.runtime.parallel.shard_rules import ModuleInfo, place, shard_pieces


# ---- pipeline stages ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    [
        (61, 2, (31, 30)),  # vLLM get_pp_indices: remainder before the last stage
        (61, 4, (15, 15, 16, 15)),
        (62, 4, (15, 16, 16, 15)),
        (3, 2, (2, 1)),
        (4, 4, (1, 1, 1, 1)),
        (5, 1, (5,)),
    ],
)
def test_pp_partition_follows_vllm(layers: int, pp: int, want: tuple[int, ...]) -> None:
    assert pp_partition(layers, pp) == want


def test_stages_are_contiguous_and_cover_every_layer() -> None:
    stages = [ParallelLayout(pp_size=4, pp_rank=r).stage_layers(61) for r in range(4)]
    assert [list(s) for s in stages] == [
        list(range(0, 15)),
        list(range(15, 30)),
        list(range(30, 46)),
        list(range(46, 61)),
    ]
    assert ParallelLayout(pp_size=4, pp_rank=0).is_first_stage
    assert ParallelLayout(pp_size=4, pp_rank=3).is_last_stage


def test_pp_layers_override_and_refusals() -> None:
    lay = ParallelLayout(pp_size=2, pp_rank=1, pp_layers=(1, 2))
    assert list(lay.stage_layers(3)) == [1, 2]
    with pytest.raises(HetquantError, match="sum to 3, but the model has 4"):
        lay.stage_layers(4)
    with pytest.raises(HetquantError, match="must give 2 stage sizes"):
        ParallelLayout(pp_size=2, pp_layers=(3,))
    with pytest.raises(HetquantError, match=r"valid pp sizes: 1\.\.3"):
        ParallelLayout(pp_size=4).stage_layers(3)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank 2 is outside 0..1"),
        ({"tp_size": 0}, "tp_size must be an integer >= 1"),
        ({"ep_size": 2, "ep_rank": -1}, "ep_rank -1"),
        ({"physical_to_logical": ((),)}, "non-empty"),
        ({"accel_experts": -1}, ">= 0"),
        ({"accel_experts": "all"}, "accel_experts must be"),
    ],
)
def test_bad_coordinates_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(HetquantError, match=needle):
        ParallelLayout(**kwargs)


def test_layout_is_frozen_and_hashable() -> None:
    lay = ParallelLayout(tp_size=2, accel_experts={2: [5, 1], 1: (3,)})
    assert lay.accel_experts == ((1, (3,)), (2, (1, 5)))
    assert hash(lay) == hash(ParallelLayout(tp_size=2, accel_experts={1: [3], 2: [1, 5]}))
    with pytest.raises(AttributeError):
        lay.tp_size = 4  # type: ignore[misc]


# ---- experts ------------------------------------------------------------------------------------
def test_contiguous_expert_blocks_without_a_map() -> None:
    owned = [ParallelLayout(ep_size=4, ep_rank=r).owned_experts(0, 8) for r in range(4)]
    assert owned == [(0, 1), (2, 3), (4, 5), (6, 7)]
    with pytest.raises(
        HetquantError, match=r"ep_size 3 does not divide .*valid ep sizes: 1, 2, 4, 8"
    ):
        ParallelLayout(ep_size=3).expert_slots(0, 8)


def test_redundant_map_nine_slots_two_ranks() -> None:
    phy2log = ((3, 1, 0, 2, 7, 6, 5, 4, 3),)  # expert 3 replicated
    ranks = [ParallelLayout(ep_size=2, ep_rank=r, physical_to_logical=phy2log) for r in range(2)]
    assert [list(r.expert_slots(0, 8)) for r in ranks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [r.owned_experts(0, 8) for r in ranks] == [(3, 1, 0, 2, 7), (6, 5, 4, 3)]
    assert set().union(*(r.owned_experts(0, 8) for r in ranks)) == set(range(8))


def test_map_rows_per_layer() -> None:
    rows = ((0, 1, 2, 3), (3, 2, 1, 0))
    lay = ParallelLayout(ep_size=2, ep_rank=0, physical_to_logical=rows)
    assert lay.owned_experts(1, 4) == (3, 2)
    with pytest.raises(HetquantError, match="needs one"):
        lay.owned_experts(2, 4)


def test_accel_ids() -> None:
    assert ParallelLayout().accel_ids(1, 8) is None
    assert ParallelLayout(accel_experts=3).accel_ids(1, 8) == {0, 1, 2}
    mapped = ParallelLayout(accel_experts={1: [6, 2]})
    assert mapped.accel_ids(1, 8) == {2, 6}
    assert mapped.accel_ids(2, 8) == frozenset()


# ---- role table ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefix", "group", "dim", "layer", "expert"),
    [
        ("model.embed_tokens", "embed", 0, None, None),
        ("lm_head", "head", 0, None, None),
        ("model.norm", "norms", None, None, None),
        ("model.layers.7.self_attn.q_a_proj", "attention", None, 7, None),
        ("model.layers.7.self_attn.q_b_proj", "attention", 0, 7, None),
        ("model.layers.7.self_attn.kv_a_proj_with_mqa", "attention", None, 7, None),
        ("model.layers.7.self_attn.kv_b_proj", "attention", 0, 7, None),
        ("model.layers.7.self_attn.o_proj", "attention", 1, 7, None),
        ("model.layers.7.self_attn.kv_a_layernorm", "norms", None, 7, None),
        ("model.layers.0.mlp.up_proj", "dense_mlp", 0, 0, None),
        ("model.layers.0.mlp.down_proj", "dense_mlp", 1, 0, None),
        ("model.layers.3.mlp.shared_experts.gate_proj", "shared_experts", 0, 3, None),
        ("model.layers.3.mlp.gate", "router", None, 3, None),
        ("model.layers.3.mlp.experts.255.down_proj", "routed", 1, 3, 255),
        ("model.layers.3.mlp.experts.17.gate_proj", "routed", 0, 3, 17),
        ("model.layers.3.mlp.experts", "cpu", None, 3, None),
        ("model.layers.61.eh_proj", "mtp", None, 61, None),
        ("model.layers.61.embed_tokens", "embed", 0, 61, None),
        ("model.layers.61.shared_head.head", "head", 0, 61, None),
        ("model.layers.61.shared_head.norm", "mtp", None, 61, None),
    ],
)
def test_roles(prefix: str, group: str, dim: int | None, layer: int | None, expert) -> None:
    pl = place(prefix)
    assert (pl.rule.group, pl.rule.dim, pl.layer, pl.expert) == (group, dim, layer, expert)


def test_unknown_module_refused() -> None:
    with pytest.raises(HetquantError, match="not a module of model family deepseek_v3"):
        place("model.layers.0.self_attn.rotary_emb")


# ---- every format: shards dequantize to the weight's slices -------------------------------------
W8A8_OPTS = {"act_min": -1.5, "act_max": 2.0}
# (format, params, shape [out, in], quantize options, unit along out, unit along in)
CASES = [
    ("bf16", {}, (64, 128), {}, 1, 1),
    ("awq_w4a16", {"group_size": 128}, (64, 512), {}, 8, 128),
    ("awq_w4a16", {"group_size": 64}, (64, 256), {}, 8, 64),
    ("ct_pack_quantized", {"group_size": 32}, (64, 256), {}, 1, 32),
    ("int4_cpu", {}, (64, 128), {}, 1, 2),
    ("w8a8_dynamic", {}, (64, 128), {}, 1, 1),
    ("w8a8", {}, (64, 128), W8A8_OPTS, 1, 1),
    ("nvfp4", {}, (64, 256), {}, 1, 16),
    ("nvfp4", {"with_input_scale": True}, (64, 256), {"act_amax": 3.0}, 1, 16),
    ("nvfp4_ascend", {}, (512, 256), {}, 256, 64),
    ("fp8_block", {}, (256, 512), {}, 128, 128),
]


def _module(fmt, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> ModuleInfo:
    entries = {
        k: ("mem", HeaderEntry(k, st_dtype(t.dtype), tuple(t.shape), 0, t.nbytes))
        for k, t in tensors.items()
    }
    return ModuleInfo("model.layers.0.mlp.up_proj", fmt, shape, entries)


def _cut(fmt, tensors: dict[str, torch.Tensor], pieces, bounds) -> dict[str, torch.Tensor]:
    """Apply pieces to in-memory tensors, the way the loader applies them to file bytes."""
    out = {}
    for key, p in pieces.items():
        t = tensors[key]
        if p.axis is not None:
            t = t.reshape(p.view).narrow(p.axis, p.start, p.stop - p.start)
        out[key] = t.reshape(p.shape).clone()
    return fmt.shard_fixup(out, *bounds)


@pytest.mark.parametrize(("name", "params", "shape", "opts", "u_out", "u_in"), CASES)
def test_format_shards_dequantize_to_slices(name, params, shape, opts, u_out, u_in) -> None:
    fmt = get_format(name, **params)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.1
    tensors = fmt.quantize(w, **opts)
    full = fmt.dequantize(tensors)
    info = _module(fmt, tensors, shape)
    for dim, unit in ((0, u_out), (1, u_in)):
        for world in (1, 2, 4, 8):
            per = shape[dim] // world
            if per % unit:
                with pytest.raises(HetquantError, match="quantization unit"):
                    shard_pieces(info, dim, 0, per)
                continue
            parts = []
            for rank in range(world):
                rng = (rank * per, (rank + 1) * per)
                bounds = (rng, (0, shape[1])) if dim == 0 else ((0, shape[0]), rng)
                shard = _cut(fmt, tensors, shard_pieces(info, dim, *rng), bounds)
                fmt.check_stored(shard, (per, shape[1]) if dim == 0 else (shape[0], per))
                if name == "nvfp4_ascend":
                    want = tiled_slice(tensors, dim, rank, world)
                    assert all(torch.equal(shard[k].view(-1), want[k].view(-1)) for k in want)
                parts.append(fmt.dequantize(shard))
            assert torch.equal(torch.cat(parts, dim=dim), full), (name, dim, world)


def test_padded_fp8_blocks_are_not_split() -> None:
    fmt = get_format("fp8_block")
    tensors = fmt.quantize(torch.randn(576, 256))  # 4.5 blocks of rows
    with pytest.raises(HetquantError, match="padded blocks cannot be split"):
        shard_pieces(_module(fmt, tensors, (576, 256)), 0, 0, 288)
    assert math.prod(tensors["weight_scale_inv"].shape) == 10


def test_first_slots_count_each_redundant_expert_once() -> None:
    # 9 physical slots over 8 experts: expert 3 is replicated in slot 8
    lay = ParallelLayout(ep_size=2, ep_rank=0, physical_to_logical=((0, 1, 2, 3, 4, 5, 6, 7, 3),))
    first = lay.first_slots(0, 8)
    assert first[3] == 3 and first[7] == 7 and len(first) == 8
    assert ParallelLayout().first_slots(0, 4) == {0: 0, 1: 1, 2: 2, 3: 3}
