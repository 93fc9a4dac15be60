"""fp4_cpu_experts: DeepSeek-V4's FP4 experts repacked losslessly for the CPU pool, and the
exact integer GEMV reference (int8 activations × the 16-entry E2M1×2 table)."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError, get_expert_format, get_format
from hetquant.formats.expert_repack import EXPERT_REPACKS, repack_target
from hetquant.formats.fp4_cpu import dequantize_rows, expert_from_fp4, fp4_gemv_int8, stack_experts

FP4 = get_format("fp4_e2m1")
GOLDEN_EXPERT = "34f60fb9068d26dc81b49aac8069b1026a43806f00f0644f8c217814c8483e83"
LAYOUT = get_expert_format("fp4_cpu_experts")


def _expert(seed: int, inter: int = 64, hidden: int = 96) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(seed)
    return tuple(FP4.quantize(torch.randn(shape, generator=g) * 0.05)
                 for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))  # fmt: skip


def test_repack_is_registered_and_lossless() -> None:
    assert repack_target("fp4_e2m1") == "fp4_cpu_experts"
    assert EXPERT_REPACKS["fp4_e2m1", "fp4_cpu_experts"] is expert_from_fp4
    gate, up, down = _expert(0)
    s = expert_from_fp4(gate, up, down)
    want = LAYOUT.stored(1, 96, 64)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in stack_experts([s]).items()} == {
        k: (getattr(torch, {"U8": "uint8", "F8_E8M0": "float8_e8m0fnu"}[m.dtype]), m.shape)
        for k, m in want.items()
    }
    gu = dequantize_rows(s["gate_up_packed"], s["gate_up_scale"])
    assert torch.equal(gu[0::2], FP4.dequantize(gate)) and torch.equal(gu[1::2], FP4.dequantize(up))
    assert torch.equal(dequantize_rows(s["down_packed"], s["down_scale"]), FP4.dequantize(down))
    assert torch.equal(s["down_packed"], down["weight"].view(torch.uint8))  # the same bytes


def test_gemv_is_the_exact_integer_sum() -> None:
    """Per 32-group an exact integer, scaled by a power of two: equal to float64 arithmetic on
    the int8 activations and the dequantized weight, bit for bit."""
    gate, _, _ = _expert(1)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    got = fp4_gemv_int8(gate["weight"].view(torch.uint8), gate["scale"], x)
    sx = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(x / sx)
    want = ((q.double() @ FP4.dequantize(gate).double().T) * sx.double()).float()
    assert torch.equal(got, want)
    assert float((got - x @ FP4.dequantize(gate).T).abs().max()) < 0.01 * float(got.abs().max())


def test_subpools_fall_on_whole_groups() -> None:
    LAYOUT.check_subpools(128, 4)
    with pytest.raises(HetquantError, match=r"legal subpool counts: \[1, 2\]"):
        LAYOUT.check_subpools(64, 4)
    layer = stack_experts([expert_from_fp4(*_expert(s)) for s in range(3)])
    halves = [LAYOUT.subpool_slice(layer, s, 2) for s in range(2)]
    # down by rows (``subpool_down = "rows"``): each half holds whole rows, all their groups
    assert torch.equal(torch.cat([h["down_scale"] for h in halves], dim=1).view(torch.uint8),
                       layer["down_scale"].view(torch.uint8))  # fmt: skip
    assert torch.equal(torch.cat([h["down_packed"] for h in halves], dim=1), layer["down_packed"])
    assert torch.equal(
        torch.cat([h["gate_up_packed"] for h in halves], dim=1), layer["gate_up_packed"]
    )


def test_bad_expert_refused() -> None:
    gate, up, down = _expert(3)
    with pytest.raises(HetquantError, match="expected gate = up = \\[I, H\\], down = \\[H, I\\]"):
        expert_from_fp4(gate, up, gate)
    bad = {**gate, "scale": gate["scale"].clone()}
    bad["scale"].view(torch.uint8)[0, 0] = 0xFF
    with pytest.raises(HetquantError, match=r"expert_from_fp4: gate\.scale: 1 NaN scale"):
        expert_from_fp4(bad, up, down)
    with pytest.raises(HetquantError, match="expected fp4_e2m1's weight and scale"):
        expert_from_fp4({"weight": gate["weight"]}, up, down)


def test_golden_bytes_of_one_expert() -> None:
    """A fixed expert (I = 32, H = 64; codes and exponents by formula) stacks to these bytes."""
    import hashlib

    def linear(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
        codes = (torch.arange(n * k).reshape(n, k) * (2 * seed + 1)) % 16
        exps = 120 + (torch.arange(n * k // 32).reshape(n, k // 32) + seed) % 15
        return {"weight": pack(codes), "scale": exps.to(torch.uint8).view(torch.float8_e8m0fnu)}

    from hetquant.formats.fp4_e2m1 import pack_e2m1 as pack

    layer = stack_experts(
        [expert_from_fp4(linear(32, 64, 0), linear(32, 64, 1), linear(64, 32, 2))]
    )
    assert layer["gate_up_packed"][0, :2, :4].tolist() == [[0x10, 0x32, 0x54, 0x76],
                                                           [0x30, 0x96, 0xFC, 0x52]]  # fmt: skip  # up: codes 0, 3, 6, …
    assert layer["gate_up_scale"][0, :2].view(torch.uint8).tolist() == [[120, 121], [121, 122]]
    digest = hashlib.sha256(b"".join(layer[k].contiguous().view(torch.uint8).numpy().tobytes()
                                     for k in sorted(layer))).hexdigest()  # fmt: skip
    assert digest == GOLDEN_EXPERT
