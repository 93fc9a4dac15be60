"""Tests of formats/int4_cpu_layer.py: the stacked layer's golden bytes, its agreement with the
per-linear format, subpool views and partial sums, and refused layers."""

from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from hetquant.formats import HetquantError, TensorMeta
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.int4_cpu import Int4Cpu
from hetquant.formats.int4_cpu_layer import (
    LAYER_KEYS,
    dequantize_expert,
    expert_forward,
    layer_stored,
    quantize_expert,
    stack_experts,
    subpool_slice,
)

FMT = Int4Cpu()
U32 = 2.0**-24  # unit roundoff of float32
SILU_MAX_SLOPE = 1.1  # max |silu'(x)| = 1.0998…


def _f32le(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _expert(inter: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(2, inter, hidden, generator=g)
    down = torch.randn(hidden, inter, generator=g) * 0.1
    return gate, up, down


def _metas(tensors: dict[str, torch.Tensor]) -> dict[str, TensorMeta]:
    return {k: TensorMeta(st_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items()}


def _layer(num_experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return stack_experts([quantize_expert(*_expert(inter, hidden, e)) for e in range(num_experts)])


# --- golden bytes --------------------------------------------------------------------------------


def test_golden_bytes_layer() -> None:
    gate = torch.tensor([[7.0, -7.0], [0.0, 7.0]])  # s 1, 1:     c 15 1 | 8 15
    up = torch.tensor([[14.0, 2.0], [-3.5, 3.5]])  # s 2, 0.5:     c 15 9 | 1 15
    down = torch.tensor([[7.0, 1.0], [0.25, -1.75]])  # s 1, 0.25: c 15 9 | 9 1
    layer = stack_experts([quantize_expert(gate, up, down)])
    # gate/up rows interleaved: gate 0, up 0, gate 1, up 1
    assert layer["gate_up_packed"].numpy().tobytes() == bytes([0x1F, 0x9F, 0xF8, 0xF1])
    assert layer["gate_up_scale"].numpy().tobytes() == _f32le(1.0, 2.0, 1.0, 0.5)
    assert layer["down_packed"].numpy().tobytes() == bytes([0x9F, 0x19])
    assert layer["down_scale"].numpy().tobytes() == _f32le(1.0, 0.25)
    got = dequantize_expert(layer, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, (gate, up, down), strict=True))


# --- the layer layout ----------------------------------------------------------------------------


def test_stacked_layer_equals_per_expert_and_per_linear(tmp_path) -> None:
    experts = [_expert(12, 20, seed) for seed in range(3)]
    parts = [quantize_expert(*x, clip_search=True) for x in experts]
    layer = stack_experts(parts)
    assert _metas(layer) == layer_stored(3, 20, 12)
    for e, (gate, up, down) in enumerate(experts):
        for key in LAYER_KEYS:
            assert torch.equal(layer[key][e], parts[e][key])
        # rows 0::2 / 1::2 / down are exactly the per-linear format of gate / up / down
        for rows_, w in ((slice(0, None, 2), gate), (slice(1, None, 2), up)):
            t = FMT.quantize(w, clip_search=True)
            assert torch.equal(layer["gate_up_packed"][e, rows_], t["weight_packed"])
            assert torch.equal(layer["gate_up_scale"][e, rows_], t["weight_scale"])
        t = FMT.quantize(down, clip_search=True)
        assert torch.equal(layer["down_packed"][e], t["weight_packed"])
        got = dequantize_expert(layer, e)
        want = (FMT.dequantize(FMT.quantize(w, clip_search=True)) for w in (gate, up, down))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # what a cpu_experts/layer_XX.safetensors file holds, byte for byte
    save_file(layer, tmp_path / "layer_03.safetensors")
    with safe_open(tmp_path / "layer_03.safetensors", framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), layer[k]) for k in LAYER_KEYS)


def _partial_sum_bound(layer, e: int, x: torch.Tensor, num_subpools: int) -> torch.Tensor:
    """Float32 rounding bound on |full − Σ partials| (first order, ×2 margin).

    In real arithmetic the two are equal. Each path computes the gate/up dot products (length H)
    to within γ_H·(|W|·|x|), γ_n ≈ n·u, so they differ by ≤ 2γ_H·(|W|·|x|); that moves the
    activation by ≤ silu'·δg·|u| + |silu(g)|·δu, plus a few u·|act| for silu and the product.
    Down products (length I, I/S) and the sum of S partials add (2I + S)·u·(|down|·|act|).
    """
    gate, up, down = (t.double() for t in dequantize_expert(layer, e))
    hidden, inter = down.shape
    x = x.double()
    g, u = x @ gate.T, x @ up.T
    dg = 2 * hidden * U32 * (x.abs() @ gate.abs().T)
    du = 2 * hidden * U32 * (x.abs() @ up.abs().T)
    act = F.silu(g) * u
    dact = SILU_MAX_SLOPE * dg * u.abs() + F.silu(g).abs() * du + 8 * U32 * act.abs()
    dout = dact @ down.abs().T + (2 * inter + num_subpools) * U32 * (act.abs() @ down.abs().T)
    return 2 * dout


@pytest.mark.parametrize("num_subpools", [1, 2, 4, 8, 16])
def test_subpool_partial_sums_equal_full_expert(num_subpools: int) -> None:
    layer = _layer(3, 64, 32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    views = [subpool_slice(layer, s, num_subpools) for s in range(num_subpools)]
    for e in range(3):
        full = expert_forward(layer, e, x)
        parts = sum(expert_forward(v, e, x) for v in views)
        assert ((full - parts).abs() <= _partial_sum_bound(layer, e, x, num_subpools)).all()
        parts64 = sum(expert_forward(v, e, x.double()) for v in views)  # no float32 noise
        torch.testing.assert_close(parts64, expert_forward(layer, e, x.double()))


def test_subpool_views_share_storage() -> None:
    layer = _layer(2, 16, 24)  # I = 24, S = 3 → slices of 8 (4 bytes of each down row)
    for s in range(3):
        view = subpool_slice(layer, s, 3)
        assert _metas(view) == layer_stored(2, 16, 8)  # a subpool is a layer of inter I/S
        offset = {"gate_up_packed": 2 * 8 * s * 8, "gate_up_scale": 2 * 8 * s * 4}
        offset |= {"down_packed": 4 * s, "down_scale": 0}
        for key in LAYER_KEYS:
            full, v = layer[key], view[key]
            assert v.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            assert v.data_ptr() == full.data_ptr() + offset[key]
        for e in range(2):
            g, u, d = dequantize_expert(view, e)
            fg, fu, fd = dequantize_expert(layer, e)
            assert torch.equal(g, fg[8 * s : 8 * s + 8]) and torch.equal(u, fu[8 * s : 8 * s + 8])
            assert torch.equal(d, fd[:, 8 * s : 8 * s + 8])


# --- refused inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: layer_stored(8, 16, 7), id="layer-odd-inter"),
        pytest.param(
            lambda: quantize_expert(torch.ones(8, 6), torch.ones(8, 6), torch.ones(8, 6)),
            id="expert-down-shape",
        ),
        pytest.param(
            lambda: quantize_expert(torch.ones(3, 6), torch.ones(3, 6), torch.ones(6, 3)),
            id="expert-odd-inter",
        ),
        pytest.param(lambda: stack_experts([]), id="stack-empty"),
        pytest.param(
            lambda: stack_experts(
                [quantize_expert(*_expert(8, 6, 0)), quantize_expert(*_expert(4, 6, 0))]
            ),
            id="stack-mismatch",
        ),
        pytest.param(lambda: dequantize_expert(_layer(2, 6, 8), 2), id="expert-out-of-range"),
        pytest.param(lambda: subpool_slice(_layer(1, 6, 24), 0, 5), id="S-not-dividing-I"),
        pytest.param(lambda: subpool_slice(_layer(1, 6, 24), 0, 8), id="I/S-odd"),
        pytest.param(lambda: subpool_slice(_layer(1, 6, 24), 0, 0), id="S-zero"),
        pytest.param(lambda: subpool_slice(_layer(1, 6, 24), 4, 4), id="s-out-of-range"),
        pytest.param(
            lambda: subpool_slice(
                {k: v for k, v in _layer(1, 6, 8).items() if k != "down_scale"}, 0, 1
            ),
            id="layer-missing-tensor",
        ),
        pytest.param(lambda: expert_forward(_layer(1, 6, 8), 0, torch.ones(4)), id="x-features"),
    ],
)
def test_bad_inputs_refused(call) -> None:
    with pytest.raises(HetquantError):
        call()
