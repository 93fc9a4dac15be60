"""Pieces, without artifacts: for every weight format, each TP rank's pieces (shard_pieces: the
format's shard_view / shard_axes / shard_fixup) dequantize to exactly that rank's rows or columns
of the whole weight, for every degree the format's units allow; every other degree is refused. The
units are written out here independently of the formats' code. ``Piece.span``: the file bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from hetquant.formats import HetquantError, get_format
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.nvfp4_ascend import tiled_slice
from hetquant.formats.safetensors_io import HeaderEntry
from hetquant.runtime.parallel.pieces import ModuleInfo, shard_pieces

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
