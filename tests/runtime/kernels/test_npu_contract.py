"""``runtime.npu_emulation`` against the torch_npu documentation, and the npu repacks' golden bits (the
matmuls' formulas and refusals are in test_npu_emulation_matmul.py).

Every expectation here comes from the documentation (Ascend/op-plugin ``docs/context/torch_npu-*.md``,
summarized in reference/ascend_formats.md §3) or from a hand computation written next to it, not
from running the emulation. Nothing here ran on Ascend hardware; the one test that compares with
the real torch_npu skips when it is not installed.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hetquant.formats.awq_w4a16 import AWQ_ORDER
from hetquant.formats.bits import pack_nibbles_i32, unpack_nibbles_i32
from hetquant.runtime.kernels import npu_emulation as emu
from hetquant.runtime.kernels.backends.npu import awq_to_int4pack
from hetquant.runtime.kernels.ops import QuantLinear

BF16, FP16, F32, I8, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32


def i32(word: int) -> int:
    """A 32-bit pattern as the signed int32 value torch stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


# -- prototypes -----------------------------------------------------------------------------------

DOCUMENTED = {  # name -> the documented prototype's parameters (name, default or None, kw-only)
    "npu_dynamic_quant": "x | *smooth_scales=None | *group_index=None | *dst_type=None",
    "npu_quantize": "input | scales | zero_points | dtype | axis=1 | div_mode=True",
    "npu_quant_matmul": "x1 | x2 | scale | *offset=None | *pertoken_scale=None | *bias=None | "
    "*output_dtype=None | *group_sizes=None",
    "npu_weight_quant_batchmatmul": "x | weight | antiquant_scale | antiquant_offset=None | "
    "quant_scale=None | quant_offset=None | bias=None | antiquant_group_size=0 | inner_precise=0",
    "npu_convert_weight_to_int4pack": "weight | inner_k_tiles=0",
    "npu_format_cast": "input | acl_format | customize_dtype=None",
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_signatures_match_the_documented_prototypes(name: str) -> None:
    parts = []
    for p in inspect.signature(getattr(emu, name)).parameters.values():
        star = "*" if p.kind is p.KEYWORD_ONLY else ""
        default = "" if p.default is p.empty else f"={p.default!r}"
        parts.append(f"{star}{p.name}{default}")
    assert " | ".join(parts) == DOCUMENTED[name]


# -- npu_dynamic_quant ----------------------------------------------------------------------------


def test_dynamic_quant_formula_by_hand() -> None:
    # amax 2 -> r = 127/2 = 63.5; x*r = 63.5, -127, 31.75, 15.875 -> rint (ties to even) 64, -127, 32, 16
    x = torch.tensor([[1.0, -2.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0]], dtype=BF16)
    y, scale = emu.npu_dynamic_quant(x)
    assert y.dtype == I8 and y.tolist() == [[64, -127, 32, 16], [0, 0, 0, 0]]
    assert scale.dtype == F32 and scale.shape == (2,)
    assert scale[0].item() == (torch.tensor(1.0) / torch.tensor(63.5)).item() and scale[1] == 0
    y3, s3 = emu.npu_dynamic_quant(torch.ones(2, 3, 8, dtype=FP16))
    assert y3.shape == (2, 3, 8) and s3.shape == (2, 3) and bool((y3 == 127).all())


def test_dynamic_quant_smooth_scales() -> None:
    x = torch.tensor([[1.0, 1.0]], dtype=FP16)
    y, scale = emu.npu_dynamic_quant(x, smooth_scales=torch.tensor([2.0, 1.0], dtype=FP16))
    assert y.tolist() == [[127, 64]] and scale.item() == pytest.approx(2 / 127)  # 63.5 -> 64


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"x": torch.ones(2, 8)}, RuntimeError),  # float32 x
        ({"x": torch.ones(8, dtype=BF16)}, RuntimeError),  # dim must be > 1
        (
            {"x": torch.ones(2, 8, dtype=BF16), "smooth_scales": torch.ones(7, dtype=BF16)},
            RuntimeError,
        ),
        ({"x": torch.ones(2, 8, dtype=BF16), "smooth_scales": torch.ones(8)}, RuntimeError),
        ({"x": torch.ones(2, 8, dtype=BF16), "dst_type": torch.int32}, RuntimeError),
        ({"x": torch.ones(2, 8, dtype=BF16), "dst_type": torch.quint4x2}, NotImplementedError),
        (
            {"x": torch.ones(2, 8, dtype=BF16), "group_index": torch.tensor([2], dtype=I32)},
            NotImplementedError,
        ),
    ],
)
def test_dynamic_quant_rejects(kwargs: dict, exc: type) -> None:
    x = kwargs.pop("x")
    with pytest.raises(exc):
        emu.npu_dynamic_quant(x, **kwargs)


# -- npu_quantize ---------------------------------------------------------------------------------


def test_quantize_formula_by_hand() -> None:
    # div_mode=False: rint(x * 2 + 1), ties to even, saturated: 1.5->2, 2.5->2, 0, 201->127, -199->-128
    x = torch.tensor([[0.25, 0.75, -0.5, 100.0, -100.0]], dtype=BF16)
    s, z = torch.tensor([2.0], dtype=BF16), torch.tensor([1.0], dtype=BF16)
    y = emu.npu_quantize(x, s, z, torch.qint8, -1, False)
    assert y.dtype == I8 and y.tolist() == [[2, 2, 0, 127, -128]]
    per_channel = emu.npu_quantize(
        x, torch.full((5,), 2.0, dtype=BF16), None, torch.qint8, -1, False
    )
    assert per_channel.tolist() == [[0, 2, -1, 127, -128]]  # 0.5->0, 1.5->2, -1, saturated


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        (
            (torch.ones(1, 4, dtype=BF16), torch.ones(1, dtype=BF16), None, torch.qint8, -1, True),
            NotImplementedError,
        ),
        (
            (
                torch.ones(1, 8, dtype=BF16),
                torch.ones(1, dtype=BF16),
                None,
                torch.quint4x2,
                -1,
                False,
            ),
            NotImplementedError,
        ),
        (
            (
                torch.ones(1, 4, dtype=BF16),
                torch.ones(1, dtype=BF16),
                None,
                torch.quint8,
                -1,
                False,
            ),
            RuntimeError,
        ),
        (
            (torch.ones(1, 4, dtype=BF16), torch.ones(3, dtype=BF16), None, torch.qint8, -1, False),
            RuntimeError,
        ),
        (
            (
                torch.ones(1, 4, dtype=BF16),
                torch.ones(4, dtype=BF16),
                torch.ones(4),
                torch.qint8,
                -1,
                False,
            ),
            RuntimeError,
        ),
        (
            (torch.ones(1, 4, dtype=I32), torch.ones(4, dtype=BF16), None, torch.qint8, -1, False),
            RuntimeError,
        ),
        (
            (torch.ones(1, 4, dtype=BF16), torch.ones(4, dtype=BF16), None, torch.qint8, -3, False),
            RuntimeError,
        ),
    ],
)
def test_quantize_rejects(args: tuple, exc: type) -> None:
    with pytest.raises(exc):
        emu.npu_quantize(*args)


# -- npu_convert_weight_to_int4pack ---------------------------------------------------------------


def test_int4pack_golden_bytes() -> None:
    # element j -> bits 4j..4j+3, two's complement: 1, -1, 2, -2, 3, -3, 7, -8 = nibbles
    # 1, F, 2, E, 3, D, 7, 8 -> word 0x87D3E2F1, little-endian bytes F1 E2 D3 87
    w = torch.tensor([[1, -1, 2, -2, 3, -3, 7, -8], [0, 1, 2, 3, 4, 5, 6, 7]], dtype=I32)
    packed = emu.npu_convert_weight_to_int4pack(w)
    assert packed.dtype == I32 and packed.shape == (2, 1)
    assert packed[:, 0].tolist() == [i32(0x87D3E2F1), 0x76543210]
    assert bytes(packed[0].numpy().tobytes()) == bytes([0xF1, 0xE2, 0xD3, 0x87])
    wide = emu.npu_convert_weight_to_int4pack(torch.full((3, 16), -8, dtype=I32))
    assert wide.shape == (3, 2) and bool((wide == i32(0x88888888)).all())


def test_int4pack_equals_vllm_ascend_byte_pairs() -> None:
    # vllm-ascend W4A8: byte j = (w[2j+1] << 4) | (w[2j] & 0xF), viewed as int32 (little-endian)
    w = torch.randint(-8, 8, (16, 64), dtype=I32, generator=torch.Generator().manual_seed(0))
    pairs = ((w[:, 1::2] << 4) | (w[:, 0::2] & 0xF)).to(torch.uint8)
    assert torch.equal(emu.npu_convert_weight_to_int4pack(w), pairs.view(I32))


@pytest.mark.parametrize(
    ("weight", "exc"),
    [
        (torch.zeros(2, 8, dtype=I8), RuntimeError),
        (torch.zeros(8, 2, dtype=I32).T, RuntimeError),  # not contiguous
        (torch.zeros(8, dtype=I32), RuntimeError),
        (torch.zeros(2, 2, 8, dtype=I32), RuntimeError),
        (torch.zeros(2, 12, dtype=I32), RuntimeError),  # last dim % 8
        (torch.full((1, 8), 8, dtype=I32), RuntimeError),  # outside [-8, 7]
        (torch.full((1, 8), -9, dtype=I32), RuntimeError),
        (torch.zeros(2, 8), NotImplementedError),  # float32 = FP4 input on Ascend 950
    ],
)
def test_int4pack_rejects(weight: torch.Tensor, exc: type) -> None:
    with pytest.raises(exc):
        emu.npu_convert_weight_to_int4pack(weight)


# -- npu_format_cast ------------------------------------------------------------------------------


def test_format_cast_is_identity_on_values() -> None:
    w = torch.arange(12, dtype=I8).reshape(3, 4)
    nz = emu.npu_format_cast(w, 29)
    assert torch.equal(nz, w) and nz.data_ptr() != w.data_ptr()
    assert (
        emu.get_npu_format(nz) == emu.ACL_FORMAT_FRACTAL_NZ
        and emu.get_npu_format(w) == emu.ACL_FORMAT_ND
    )
    with pytest.raises(NotImplementedError):
        emu.npu_format_cast(w, 3)


# -- AWQ repack (sglang) --------------------------------------------------------------------------


def test_awq_repack_golden_word() -> None:
    # Logical outputs 0..7 hold codes u = 1..8. AWQ stores output AWQ_ORDER[i] = (0,2,4,6,1,3,5,7)[i]
    # in nibble i: nibbles (low first) 1,3,5,7,2,4,6,8 -> 0x86427531. Repacked: nibble i = u_i,
    # 0x87654321, XOR 0x88888888 -> 0x0FEDCBA9 (nibble i = u_i - 8: -7..0 as two's complement).
    before = torch.tensor([[i32(0x86427531), 0, i32(0x88888888)]], dtype=I32)
    assert unpack_nibbles_i32(before, AWQ_ORDER)[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    after = awq_to_int4pack(before)
    assert after.dtype == I32 and after.tolist() == [[0x0FEDCBA9, i32(0x88888888), 0]]


def test_awq_repack_agrees_with_int4pack() -> None:
    q = torch.randint(
        -(2**31), 2**31, (32, 16), dtype=torch.int64, generator=torch.Generator().manual_seed(3)
    )
    q = q.to(I32)
    signed = unpack_nibbles_i32(q, AWQ_ORDER).to(I32) - 8  # (32, 128) logical, -8..7
    assert torch.equal(awq_to_int4pack(q), emu.npu_convert_weight_to_int4pack(signed))


def test_awq_offset_is_8_minus_z() -> None:
    # z = 0, 8, 15, 1, 2, 3, 4, 5 in AWQ order (nibbles z0,z2,z4,z6,z1,z3,z5,z7) -> 0x531842F0
    qzeros = torch.tensor([[i32(0x531842F0)]], dtype=I32)
    assert unpack_nibbles_i32(qzeros, AWQ_ORDER).tolist() == [[0, 8, 15, 1, 2, 3, 4, 5]]
    tensors = {
        "qweight": pack_nibbles_i32(torch.zeros(128, 8, dtype=torch.uint8), AWQ_ORDER),
        "qzeros": qzeros,
        "scales": torch.ones(1, 8, dtype=FP16),
    }
    lin = QuantLinear.from_stored("awq_w4a16", tensors, backend="npu", npu_ops=emu)
    assert lin.kernel.prepared["antiquant_offset"].tolist() == [[8, 0, -7, 7, 6, 5, 4, 3]]
    x = torch.ones(1, 128, dtype=FP16)  # W = (u - z) * 1 with u = 0: y = -128 z
    assert lin(x).tolist() == [[-128.0 * z for z in (0, 8, 15, 1, 2, 3, 4, 5)]]


# -- the real torch_npu (skipped where it is absent) ----------------------------------------------


def test_real_torch_npu_agrees_with_emulation() -> None:
    torch_npu = pytest.importorskip("torch_npu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 256, generator=g) * 3).to(BF16)
    y_emu, s_emu = emu.npu_dynamic_quant(x)
    y_npu, s_npu = torch_npu.npu_dynamic_quant(x.npu())
    assert (y_npu.cpu().int() - y_emu.int()).abs().max() <= 1  # rint ties may differ
    assert torch.allclose(s_npu.cpu(), s_emu, rtol=2**-22, atol=0)
    w = torch.randint(-8, 8, (256, 64), dtype=I32, generator=g)
    assert torch.equal(
        torch_npu.npu_convert_weight_to_int4pack(w.npu()).cpu(),
        emu.npu_convert_weight_to_int4pack(w),
    )
    w8 = torch.randint(-128, 128, (256, 64), dtype=I8, generator=g)
    scale = torch.rand(64, generator=g).to(BF16)
    args = (y_emu, w8, scale)
    ref = emu.npu_quant_matmul(*args, pertoken_scale=s_emu, output_dtype=BF16)
    got = torch_npu.npu_quant_matmul(
        *(a.npu() for a in args), pertoken_scale=s_emu.npu(), output_dtype=BF16
    )
    assert torch.allclose(got.cpu().float(), ref.float(), rtol=2**-7, atol=0)
    s = torch.rand(2, 64, generator=g).to(BF16)
    off = torch.randint(-8, 8, (2, 64), generator=g).to(BF16)
    packed = emu.npu_convert_weight_to_int4pack(w)
    ref = emu.npu_weight_quant_batchmatmul(x, packed, s, off, antiquant_group_size=128)
    got = torch_npu.npu_weight_quant_batchmatmul(
        x.npu(), packed.npu(), s.npu(), off.npu(), antiquant_group_size=128
    )
    assert torch.allclose(got.cpu().float(), ref.float(), rtol=2**-6, atol=1e-2)
