"""kt-kernel AMXINT4 layout: golden bytes from reference/cpu_experts.md §7.1, element by element.

The expected file is built here from the decoded description alone — each element's byte offset
and nibble from the tiling formula (``tests/kt_reference.py``), its value the two's-complement code — independently of
``formats/kt_amxint4.py``'s reshapes. The shape has a partial row block (160 = 128 + 32 rows) and
a partial k block (3840 = 3584 + 256), so every level of the tiling is exercised.
"""

from __future__ import annotations

import pytest
import torch
from kt_reference import offset

from hetquant.formats import HetquantError
from hetquant.formats import kt_amxint4 as amx
from hetquant.formats.bits import pack_nibbles_u8


def _golden(codes: torch.Tensor) -> bytes:
    n, k = codes.shape
    out = bytearray(n * k // 2)
    c = codes.tolist()
    for row in range(n):
        for col in range(k):
            byte, high = offset(n, k, row, col)
            nib = (c[row][col] - 8) & 0xF  # q in two's complement
            out[byte] |= nib << (4 * high)
    return bytes(out)


@pytest.mark.parametrize("n, k", [(160, 3840), (32, 128), (64, 256)])
def test_quant_file_golden_bytes(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)  # 0 (q = -8) included
    got = amx.quant_file(pack_nibbles_u8(codes))
    assert got.dtype == torch.uint8 and got.shape == (n * k // 2,)
    assert bytes(got.numpy()) == _golden(codes)


def test_strided_rows_repack_like_contiguous() -> None:
    codes = torch.randint(0, 16, (64, 512), generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles_u8(codes)  # [64, 256]
    view = torch.cat([packed, packed], dim=1)[:, :256]  # row stride 512 bytes
    assert torch.equal(amx.quant_file(view), amx.quant_file(packed))


def test_deepseek_file_sizes() -> None:
    """§7.1 sizes at N = 1: 7,340,032 B of codes per matrix, 8,192 / 28,672 B of scales."""
    assert amx.file_name("down", 17, 3670016, "quant") == "INT4_down_17_3670016Byte_quant_.kt"
    for rows, k in ((2048, 7168), (7168, 2048)):
        amx.check_shape("x", rows, k)
        assert rows * k // 2 == 7_340_032
    assert 4 * 2048 == 8_192 and 4 * 7168 == 28_672


def test_scale_is_s_over_16_exactly() -> None:
    s = torch.tensor([1.0, 0.0123, 3.5e-3, 7.0, 2.0**-100], dtype=torch.float32)
    d = amx.scale_file("w", s)
    assert d.dtype == torch.float32 and torch.equal(d * 16, s)
    assert torch.equal(d, s / 16)


@pytest.mark.parametrize("bad", [(1 + 2.0**-23) * 2.0**-125, float("nan"), float("inf")])
def test_scale_refused_when_not_exact(bad: float) -> None:
    with pytest.raises(HetquantError, match="losslessly"):
        amx.scale_file("layer 3 gate", torch.tensor([1.0, bad]))


@pytest.mark.parametrize("rows, k", [(48, 128), (32, 192), (0, 128)])
def test_layout_constraints(rows: int, k: int) -> None:
    with pytest.raises(HetquantError, match=r"multiple of 32 .* multiple of 128"):
        amx.check_shape("down slice", rows, k)
    with pytest.raises(HetquantError):
        amx.quant_file(torch.zeros(rows, k // 2, dtype=torch.uint8))
