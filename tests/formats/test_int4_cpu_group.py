"""formats/int4_cpu_group.py: golden bytes, round trips, error bound, the lossless repack from
compressed-tensors pack-quantized, the layer layout, subpool slicing on whole groups."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from hetquant.formats import EXPERT_FORMATS, FORMATS, HetquantError, TensorMeta
from hetquant.formats.ct_pack_quantized import CtPackQuantized
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.int4_cpu import LAYER_KEYS, Int4CpuExperts
from hetquant.formats.int4_cpu import layer_stored as per_channel_layer_stored
from hetquant.formats.int4_cpu_group import (
    GROUP_SIZES,
    Int4CpuGroup,
    Int4CpuGroupExperts,
    dequantize_expert,
    dequantize_rows,
    expert_from_ct,
    layer_stored,
    stack_experts,
)

FMT = Int4CpuGroup()
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


# --- golden bytes --------------------------------------------------------------------------------


def test_golden_bytes_per_linear() -> None:
    w = torch.zeros(3, 32)
    w[0, :4] = torch.tensor([7.0, -7.0, 1.0, 0.5])
    w[1, :3] = torch.tensor([1.0, -0.5, 0.07177734375])
    t = FMT.quantize(w)
    # row 0: s = 7/7 = 1 (bf16 0x3F80); q = 7 -7 1 0 (0.5 → 0: half to even); c = 15 1 9 8, 8…
    # row 1: 1/7 = 0.142857… rounded UP to bf16: 0x3E13 = 0.1435546875; w/s = 6.97 -3.48 0.5
    #        → q = 7 -3 0 (half to even); c = 15 5 8, 8…
    # row 2: all zero → s = 1.        byte j = c[2j] | c[2j+1] << 4
    want = [0x1F, 0x89] + [0x88] * 14 + [0x5F] + [0x88] * 15 + [0x88] * 16
    assert t["weight_packed"].numpy().tobytes() == bytes(want)
    assert t["weight_scale"].view(torch.int16).numpy().tobytes() == _bf16_bits(
        0x3F80, 0x3E13, 0x3F80
    )
    want_dq = torch.zeros(3, 32)
    want_dq[0, :3] = torch.tensor([7.0, -7.0, 1.0])
    want_dq[1, :2] = torch.tensor([7 * 0.1435546875, -3 * 0.1435546875])
    assert torch.equal(FMT.dequantize(t), want_dq)


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


def test_registry_and_shapes() -> None:
    assert "int4_cpu_group" in FORMATS  # served by runtime/kernels/ops.py (tinygemm; npu refuses)
    assert FMT.group_size == 32
    f64 = Int4CpuGroup(64)
    assert f64.stored((7168, 2048)) == {
        "weight_packed": TensorMeta("U8", (7168, 1024)),
        "weight_scale": TensorMeta("BF16", (7168, 32)),
    }
    assert FMT.bits_per_weight((4, 64)) == 4 + 16 / 32
    assert EXPERT_FORMATS["int4_cpu_group_experts"] == Int4CpuGroupExperts()
    metas = layer_stored(384, 7168, 2048, 32)  # Kimi K2 Thinking: 384 experts, group 32
    assert metas["gate_up_scale"] == TensorMeta("BF16", (384, 4096, 224))
    assert metas["down_scale"] == TensorMeta("BF16", (384, 7168, 64))
    # bytes per expert: codes as int4_cpu, 2 bytes per 32 weights instead of 4 per row
    per_expert = sum(m.nbytes for m in metas.values()) // 384
    assert per_expert == 3 * 2048 * 7168 // 2 + 2 * 3 * 2048 * 7168 // 32


def test_from_stored_inverts_stored() -> None:
    group = _metas(_layer(2, 64, 128, group=64))
    fmt, dims = Int4CpuGroupExperts().from_stored(group)
    assert (fmt, dims) == (Int4CpuGroupExperts(64), (2, 64, 128))
    assert fmt.stored(*dims) == group
    fmt, dims = Int4CpuExperts().from_stored(group)  # another layout's answer does not fit
    assert fmt.stored(*dims) != group
    per_channel = dict(per_channel_layer_stored(2, 64, 128))
    fmt, dims = Int4CpuExperts().from_stored(per_channel)
    assert fmt.stored(*dims) == per_channel
    with pytest.raises(IndexError):  # F32 [E, 2I] scales have no group dim
        Int4CpuGroupExperts().from_stored(per_channel)
    with pytest.raises(HetquantError, match="group_size 21"):  # 64 / 3: no group size
        Int4CpuGroupExperts().from_stored(
            dict(group, gate_up_scale=TensorMeta("BF16", (2, 256, 3)))
        )
    linear = FMT.stored((64, 256))
    assert FMT.from_stored(linear) == (Int4CpuGroup(32), (64, 256))
    assert Int4CpuGroup(128).from_stored(Int4CpuGroup(128).stored((8, 512))) == (
        Int4CpuGroup(128),
        (8, 512),
    )


# --- round trips and error bounds ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.sampled_from(GROUP_SIZES), seeds)
def test_quantize_error_bound_and_idempotence(r: int, ng: int, group: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(r, ng * group, generator=g) * torch.exp(
        torch.randn(r, ng, 1, generator=g) * 3
    ).repeat_interleave(group, 1).reshape(r, -1)
    w[0, :group] = 0  # an all-zero group
    fmt = Int4CpuGroup(group)
    t = fmt.quantize(w)
    fmt.check_stored(t, (r, ng * group))
    dq = fmt.dequantize(t)
    s = t["weight_scale"].float().repeat_interleave(group, 1)
    assert ((w - dq).abs() <= s / 2 * (1 + 2**-20)).all()
    codes = torch.stack([t["weight_packed"] & 15, t["weight_packed"] >> 4], -1).reshape(r, -1)
    assert int(codes.min()) >= 1  # our quantizer writes 1..15
    again = fmt.quantize(dq)  # a ±7 in every group: the same scales, the same codes
    assert torch.equal(again["weight_scale"], t["weight_scale"])
    assert torch.equal(again["weight_packed"], t["weight_packed"])


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
        (lambda: Int4CpuGroup(16), "group_size 16"),
        (lambda: Int4CpuGroup(48), "group_size 48"),
        (lambda: FMT.stored((4, 48)), "multiple of the group size 32"),
        (lambda: FMT.quantize(torch.ones(4, 40)), "multiple of the group size"),
        (lambda: FMT.quantize(torch.ones(2, 4, 32)), "2-D"),
        (lambda: FMT.quantize(torch.full((2, 32), float("nan"))), "NaN"),
        (lambda: FMT.quantize(torch.ones(2, 32), clip_search=True), "unknown options"),
        (
            lambda: FMT.dequantize(
                {
                    "weight_packed": torch.zeros(2, 16, dtype=torch.uint8),
                    "weight_scale": torch.full((2, 1), float("nan")).bfloat16(),
                }
            ),
            "NaN/Inf",
        ),
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
