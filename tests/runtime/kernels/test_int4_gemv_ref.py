"""runtime/kernels/int4_gemv_ref.py: the pure-torch GEMV within its float32 bound of a float64
reference (``gemv_reference.py``), per-channel and grouped, strided rows and 1-D ``x``; and the
operand checks every backend runs first."""

from __future__ import annotations

import pytest
import torch
from gemv_reference import assert_within, gemv_bound, gemv_ref

from hetquant.formats import HetquantError
from hetquant.runtime.kernels import int4_gemv as G
from hetquant.runtime.kernels.int4_gemv_ref import check_operands, int4_gemv_torch


def _operands(n: int, k: int, t: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    if group:
        scale = (torch.rand(n, k // group, generator=gen) * 0.1 + 1e-3).to(torch.bfloat16)
    else:
        scale = torch.rand(n, generator=gen) * 0.1 + 1e-3
    return packed, scale, torch.randn(t, k, generator=gen) * 10


@pytest.mark.parametrize("group", [0, 32, 128])
@pytest.mark.parametrize(("n", "k", "t"), [(1, 256, 1), (13, 512, 5), (70, 1024, 3)])
def test_torch_path_within_its_bound(n: int, k: int, t: int, group: int) -> None:
    packed, scale, x = _operands(n, k, t, group, seed=n + k + t + group)
    assert check_operands(packed, scale, x) == (n, k // 2, group)
    y = int4_gemv_torch(packed, scale, x)
    assert y.dtype == torch.float32 and y.shape == (t, n)
    assert_within(y, gemv_ref(packed, scale, x), gemv_bound(packed, scale, x, y, "torch") / 2)
    assert torch.equal(G.int4_gemv(packed, scale, x, backend="torch"), y)


def test_torch_path_strided_rows_and_1d() -> None:
    down = torch.randint(0, 256, (3, 70, 48), dtype=torch.uint8)  # [E, H, I/2]
    view = down[1, :, 16:40]  # a subpool's column slice: rows of 24 bytes, stride 48
    scale = torch.rand(70)
    x = torch.randn(48)
    y = int4_gemv_torch(view, scale, x)
    assert y.shape == (70,)
    assert torch.equal(y, int4_gemv_torch(view.contiguous(), scale, x[None])[0])


def test_kernel_bad_input():
    packed = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(HetquantError, match="expected"):
        G.int4_gemv(packed, torch.ones(4), torch.zeros(15))
    with pytest.raises(HetquantError, match="scale shape"):
        G.int4_gemv(packed, torch.ones(5), torch.zeros(16))
    with pytest.raises(HetquantError, match="backend"):
        G.int4_gemv(packed, torch.ones(4), torch.zeros(16), backend="cuda")


@pytest.mark.parametrize(
    ("scale", "match"),
    [
        (torch.ones(4, 2), "grouped scale"),  # float32, 2-D
        (torch.ones(4, 4).bfloat16(), "grouped scale"),  # group 16
        (torch.ones(4, 3).bfloat16(), "grouped scale"),  # 64 / 3
        (torch.ones(5, 2).bfloat16(), "grouped scale"),  # rows
        (torch.ones(4, 0).bfloat16(), "grouped scale"),
    ],
)
def test_bad_grouped_scales(scale, match):
    with pytest.raises(HetquantError, match=match):
        G.int4_gemv(torch.zeros(4, 32, dtype=torch.uint8), scale, torch.zeros(64))


@pytest.mark.parametrize(
    ("packed", "x", "match"),
    [
        (torch.zeros(4, 8, dtype=torch.int8), torch.zeros(16), "packed must be uint8"),
        (torch.zeros(4, 8, 1, dtype=torch.uint8), torch.zeros(16), "packed must be uint8"),
        (torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(2, 2, 16), "x shape"),
        (torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(16, dtype=torch.int32), "floating"),
    ],
)
def test_bad_operands_refused_by_the_torch_path(packed, x, match):
    with pytest.raises(HetquantError, match=match):
        int4_gemv_torch(packed, torch.ones(4), x)
