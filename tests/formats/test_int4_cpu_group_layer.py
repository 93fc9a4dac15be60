"""formats/int4_cpu_group_layer.py: the lossless repack from compressed-tensors pack-quantized
(golden bytes, bit-for-bit values), the layer file round trip, subpool slicing on whole groups,
and refused layers and experts."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from hetquant.formats import HetquantError, TensorMeta
from hetquant.formats.ct_pack_quantized import CtPackQuantized
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.int4_cpu import LAYER_KEYS
from hetquant.formats.int4_cpu_group import Int4CpuGroupExperts
from hetquant.formats.int4_cpu_group_layer import (
    dequantize_expert,
    expert_from_ct,
    layer_stored,
    stack_experts,
)
from hetquant.formats.int4_cpu_group_rows import dequantize_rows

seeds = st.integers(0, 2**31 - 1)


def _bf16_bits(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}H", *values)


def _metas(tensors: dict[str, torch.Tensor]) -> dict[str, TensorMeta]:
    return {k: TensorMeta(st_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items()}


def _ct_expert(inter: int, hidden: int, group: int, seed: int):
    """gate, up [I, H] and down [H, I] as compressed-tensors stored tensors, codes -8..7 (code 0
    included) and BF16 scales, written by compressed-tensors' own quantize with given scales."""
    g = torch.Generator().manual_seed(seed)
    ct = CtPackQuantized(group_size=group)
    out = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        q = torch.randint(-8, 8, (n, k), generator=g)
        s = (torch.rand(n, k // group, generator=g) * 0.05 + 1e-3).bfloat16()
        w = q.float() * s.float().repeat_interleave(group, 1)  # exact
        out.append(ct.quantize(w, scales=s))
    return out, ct


def _layer(num_experts: int, hidden: int, inter: int, group: int = 32) -> dict[str, torch.Tensor]:
    fmt = Int4CpuGroupExperts(group_size=group)
    g = torch.Generator().manual_seed(num_experts * hidden + inter)
    experts = []
    for _ in range(num_experts):
        gate, up = torch.randn(2, inter, hidden, generator=g)
        experts.append(fmt.quantize_expert(gate, up, torch.randn(hidden, inter, generator=g)))
    return stack_experts(experts)


def test_golden_bytes_ct_repack() -> None:
    # compressed-tensors: input 8c+i at bits 4i of word c, stored q + 8. Codes k % 16 for
    # k = 0..31: words 0x76543210, 0xFEDCBA98 (twice). Our byte j holds 2j (low), 2j+1 (high).
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - (1 << 32)] * 2], dtype=torch.int32)
    scale = torch.tensor([[0x3F00]], dtype=torch.int16).view(torch.bfloat16)  # 0.5
    lin = {  # [32, 32]: every row the same
        "weight_packed": words.repeat(32, 1),
        "weight_scale": scale.repeat(32, 1),
        "weight_shape": torch.tensor([32, 32]),
    }
    e = expert_from_ct(lin, lin, lin)
    row = bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2)
    assert e["down_packed"].numpy().tobytes() == row * 32
    assert e["gate_up_packed"].numpy().tobytes() == row * 64
    assert e["gate_up_scale"].view(torch.int16).numpy().tobytes() == _bf16_bits(0x3F00) * 64
    want = (torch.arange(32) % 16 - 8).float() * 0.5
    assert torch.equal(dequantize_rows(e["down_packed"], e["down_scale"])[5], want)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from((32, 128)), seeds)
def test_ct_repack_is_lossless(ih: int, hh: int, group: int, seed: int) -> None:
    inter, hidden = 128 * ih, 128 * hh
    (gate, up, down), ct = _ct_expert(inter, hidden, group, seed)
    layer = stack_experts([expert_from_ct(gate, up, down)])
    assert _metas(layer) == layer_stored(1, hidden, inter, group)
    got = dequantize_expert(layer, 0)
    for a, src in zip(got, (gate, up, down), strict=True):
        assert torch.equal(a, ct.dequantize(src))  # bit for bit: q · f32(s)
    codes = torch.cat([layer["down_packed"] & 15, layer["down_packed"] >> 4])
    assert int(codes.min()) == 0  # the source's q = -8 is kept
    # the repacked codes are the source's bytes, not a copy of recomputed values
    assert layer["down_packed"][0].numpy().tobytes() == down["weight_packed"].numpy().tobytes()


def test_layer_file_round_trip(tmp_path) -> None:
    layer = _layer(3, 64, 96)
    save_file(layer, tmp_path / "layer_003.safetensors")
    with safe_open(tmp_path / "layer_003.safetensors", framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), layer[k]) for k in LAYER_KEYS)
    for e in range(3):
        gate, up, down = dequantize_expert(layer, e)
        assert torch.equal(
            gate, dequantize_rows(layer["gate_up_packed"][e, 0::2], layer["gate_up_scale"][e, 0::2])
        )
        assert torch.equal(
            up, dequantize_rows(layer["gate_up_packed"][e, 1::2], layer["gate_up_scale"][e, 1::2])
        )
        assert down.shape == (64, 96)


# --- subpools ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("group", "num_subpools"), [(32, 1), (32, 2), (32, 4), (64, 2), (128, 1)])
def test_subpool_views_on_whole_groups(group: int, num_subpools: int) -> None:
    layer = _layer(2, 128, 128, group)
    fmt = Int4CpuGroupExperts(group)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).double()
    w = 128 // num_subpools
    for s in range(num_subpools):
        view = fmt.subpool_slice(layer, s, num_subpools)
        assert _metas(view) == layer_stored(2, 128, w, group)  # a subpool is a layer of I/S
        for key in LAYER_KEYS:
            assert view[key].untyped_storage().data_ptr() == layer[key].untyped_storage().data_ptr()
        for e in range(2):
            g, u, d = dequantize_expert(view, e)
            fg, fu, fd = dequantize_expert(layer, e)
            sl = slice(w * s, w * s + w)
            assert torch.equal(g, fg[sl]) and torch.equal(u, fu[sl]) and torch.equal(d, fd[:, sl])
    # the partial sums add up to the whole expert (float64: exact up to rounding)
    for e in range(2):
        fg, fu, fd = (t.double() for t in dequantize_expert(layer, e))
        full = (torch.nn.functional.silu(x @ fg.T) * (x @ fu.T)) @ fd.T
        parts = 0
        for s in range(num_subpools):
            g, u, d = (
                t.double() for t in dequantize_expert(fmt.subpool_slice(layer, s, num_subpools), e)
            )
            parts = parts + (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
        torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-12)


def test_subpools_off_groups_refused_naming_the_legal_counts() -> None:
    layer = _layer(1, 64, 128, 32)
    fmt = Int4CpuGroupExperts(32)
    for bad in (3, 8, 0):  # 128/3 no integer; 128/8 = 16 < a group of 32
        with pytest.raises(HetquantError, match=r"legal subpool counts: \[1, 2, 4\]"):
            fmt.subpool_slice(layer, 0, bad)
    with pytest.raises(HetquantError, match=r"not in 0\.\.3"):
        fmt.subpool_slice(layer, 4, 4)


# --- refused inputs ------------------------------------------------------------------------------


def _ct(**change):
    (gate, up, down), _ = _ct_expert(64, 64, 32, 0)
    parts = {"gate": dict(gate), "up": dict(up), "down": dict(down)}
    for name, value in change.items():
        which, key = name.split("__")
        if value is None:
            del parts[which][key]
        else:
            parts[which][key] = value
    return parts["gate"], parts["up"], parts["down"]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: layer_stored(2, 64, 48, 32), "moe intermediate = 48"),
        (
            lambda: expert_from_ct(*_ct(down__weight_zero_point=torch.zeros(64, 2))),
            "weight_zero_point",
        ),
        (
            lambda: expert_from_ct(*_ct(up__weight_g_idx=torch.zeros(64, dtype=torch.int32))),
            "act-order",
        ),
        (
            lambda: expert_from_ct(*_ct(gate__weight_scale=torch.ones(64, 2, dtype=torch.float16))),
            "F16",
        ),
        (
            lambda: expert_from_ct(*_ct(gate__weight_shape=torch.tensor([64, 72]))),
            "weight_packed is",
        ),
        (
            lambda: expert_from_ct(*_ct(down__weight_scale=torch.ones(64, 1).bfloat16())),
            "different groups",
        ),
        (
            lambda: expert_from_ct(*_ct(gate__weight_scale=torch.ones(64, 4).bfloat16())),
            "group size 16",
        ),
        (lambda: expert_from_ct(*_ct(up__weight_packed=None)), "needs weight_packed"),
        (lambda: stack_experts([]), "no experts"),
        (lambda: dequantize_expert(_layer(2, 64, 64), 2), "not in 0..1"),
        (
            lambda: Int4CpuGroupExperts(32).quantize_expert(
                torch.ones(64, 64), torch.ones(64, 64), torch.ones(64, 32)
            ),
            "expected gate = up",
        ),
    ],
)
def test_bad_inputs_refused(call, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        call()
