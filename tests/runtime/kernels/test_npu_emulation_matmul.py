"""``runtime/kernels/npu_emulation_matmul.py`` against the torch_npu documentation: the formulas of
``npu_quant_matmul`` and ``npu_weight_quant_batchmatmul`` by hand, and every input they refuse.

As in test_npu_contract.py, every expectation comes from the documentation (reference/ascend_formats.md
§3) or a hand computation written next to it, not from running the emulation.
"""

from __future__ import annotations

import pytest
import torch

from hetquant.runtime.kernels.npu_emulation import npu_convert_weight_to_int4pack
from hetquant.runtime.kernels.npu_emulation_matmul import (
    npu_quant_matmul,
    npu_weight_quant_batchmatmul,
)

BF16, FP16, F32, I8, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32


# -- npu_quant_matmul -----------------------------------------------------------------------------

X1 = torch.tensor([[1, 2], [3, -4]], dtype=I8)
X2 = torch.tensor([[1, 0, 2], [0, 1, -1]], dtype=I8)  # acc = [[1, 2, 0], [3, -4, 10]]
SCALE = torch.tensor([0.5, 1.0, 2.0])
PERTOKEN = torch.tensor([1.0, 0.25])


def test_quant_matmul_formulas_by_hand() -> None:
    bias = torch.tensor([1, 0, -1], dtype=I32)  # int32 bias: (acc + bias) * scale * pertoken
    y = npu_quant_matmul(X1, X2, SCALE, pertoken_scale=PERTOKEN, bias=bias, output_dtype=BF16)
    assert y.dtype == BF16 and y.tolist() == [[1.0, 2.0, -2.0], [0.5, -1.0, 4.5]]
    fbias = torch.tensor([1.0, 0.0, -1.0], dtype=BF16)  # float bias added after the scales
    y = npu_quant_matmul(X1, X2, SCALE, pertoken_scale=PERTOKEN, bias=fbias, output_dtype=BF16)
    assert y.tolist() == [[1.5, 2.0, -1.0], [1.375, -1.0, 4.0]]
    # static W8A8 row of Table 2: BF16 output, F32 scale (t = 1), int32 bias, no pertoken_scale
    y = npu_quant_matmul(X1, X2, torch.tensor([0.5]), bias=bias, output_dtype=BF16)
    assert y.tolist() == [[1.0, 1.0, -0.5], [2.0, -2.0, 4.5]]
    y = npu_quant_matmul(X1, X2, SCALE, pertoken_scale=PERTOKEN, output_dtype=FP16)
    assert y.dtype == FP16 and y.tolist() == [[0.5, 2.0, 0.0], [0.375, -1.0, 5.0]]


def test_quant_matmul_batched_with_3d_bias() -> None:
    x1 = torch.stack([X1, -X1])  # (2, 2, 2)
    bias = torch.tensor([[[0, 0, 0]], [[1, 1, 1]]], dtype=I32)  # (batch, 1, n)
    y = npu_quant_matmul(x1, X2, torch.tensor([1.0]), bias=bias, output_dtype=BF16)
    assert y.shape == (2, 2, 3) and y[1].tolist() == [[0.0, -1.0, 1.0], [-2.0, 5.0, -9.0]]


def _qmm(**kw):
    args = {"x1": X1, "x2": X2, "scale": SCALE, "output_dtype": BF16} | kw
    return npu_quant_matmul(args.pop("x1"), args.pop("x2"), args.pop("scale"), **args)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"x1": X1.float()}, RuntimeError),
        ({"x2": X2.to(I32)}, RuntimeError),  # dtypes differ
        ({"x1": torch.ones(2, 3, dtype=I8)}, RuntimeError),  # k mismatch
        ({"x1": torch.ones(2, dtype=I8)}, RuntimeError),  # fewer than 2 dims
        ({"x1": torch.ones(1, 1, 1, 1, 1, 2, 2, dtype=I8)}, RuntimeError),  # more than 6 dims
        (
            {"x1": torch.ones(1, 65536, dtype=I8), "x2": torch.ones(65536, 3, dtype=I8)},
            RuntimeError,
        ),
        (
            {
                "x1": torch.ones(1, 2, dtype=I8),
                "x2": torch.ones(2, 65536, dtype=I8),
                "scale": torch.ones(1),
            },
            RuntimeError,
        ),
        ({"scale": torch.ones(2)}, RuntimeError),  # t must be 1 or n
        ({"scale": torch.ones(1, 3)}, RuntimeError),  # 2-D scale is for int4 inputs only
        ({"scale": SCALE.half()}, RuntimeError),
        (
            {"scale": SCALE.bfloat16(), "output_dtype": FP16, "pertoken_scale": PERTOKEN},
            RuntimeError,
        ),
        ({"output_dtype": FP16, "bias": torch.zeros(3, dtype=BF16)}, RuntimeError),  # no pertoken
        ({"offset": torch.zeros(3)}, RuntimeError),  # offset is for int8 output only
        ({"pertoken_scale": PERTOKEN.half()}, RuntimeError),
        ({"pertoken_scale": torch.ones(3)}, RuntimeError),
        ({"bias": torch.zeros(4, dtype=I32)}, RuntimeError),
        ({"bias": torch.zeros(3, dtype=torch.int64)}, RuntimeError),
        ({"output_dtype": torch.float32}, RuntimeError),
        ({"output_dtype": None}, NotImplementedError),  # int8 output
        ({"output_dtype": I32}, NotImplementedError),
        ({"scale": torch.ones(3, dtype=torch.int64)}, NotImplementedError),
        ({"x1": X1.to(I32), "x2": X2.to(I32)}, NotImplementedError),  # int4 inputs
        ({"group_sizes": [1, 1, 1]}, NotImplementedError),
    ],
)
def test_quant_matmul_rejects(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        _qmm(**kwargs)


# -- npu_weight_quant_batchmatmul -----------------------------------------------------------------


def test_wqbmm_int8_per_channel_by_hand() -> None:
    # W = (w + offset) * scale = [[2*.5, -2*2], [4*.5, 4*2]] = [[1, -4], [2, 8]]; y = [1+4, -4+16]
    x = torch.tensor([[1.0, 2.0]], dtype=FP16)
    w = torch.tensor([[1, -2], [3, 4]], dtype=I8)
    s, off = torch.tensor([0.5, 2.0], dtype=FP16), torch.tensor([1.0, 0.0], dtype=FP16)
    y = npu_weight_quant_batchmatmul(x, w, s, off, bias=torch.tensor([0.5, 0.0], dtype=FP16))
    assert y.dtype == FP16 and y.tolist() == [[5.5, 12.0]]


def test_wqbmm_int4_per_group_by_hand() -> None:
    # K = 64, N = 8, group 32: rows 0..31 use scale 1, rows 32..63 scale 0.5; every weight is -8..7
    k, n = 64, 8
    vals = (torch.arange(k * n, dtype=I32).reshape(k, n) % 16) - 8
    packed = npu_convert_weight_to_int4pack(vals)
    scale = torch.tensor([[1.0] * n, [0.5] * n], dtype=BF16)
    x = torch.ones(1, k, dtype=BF16)
    y = npu_weight_quant_batchmatmul(x, packed, scale, antiquant_group_size=32)
    want = vals[:32].sum(0).float() + 0.5 * vals[32:].sum(0).float()
    assert torch.equal(y.float()[0], want)
    bias = torch.ones(n)  # F32 bias for BF16 x
    y = npu_weight_quant_batchmatmul(x, packed, scale, antiquant_group_size=32, bias=bias)
    assert torch.equal(y.float()[0], want + 1)


def _wq(**kw):
    k, n = 64, 8
    args = {
        "x": torch.ones(2, k, dtype=BF16),
        "weight": torch.zeros(k, n // 8, dtype=I32),
        "antiquant_scale": torch.ones(2, n, dtype=BF16),
        "antiquant_group_size": 32,
    } | kw
    return npu_weight_quant_batchmatmul(
        args.pop("x"), args.pop("weight"), args.pop("antiquant_scale"), **args
    )


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"x": torch.ones(2, 64)}, RuntimeError),  # x float32
        ({"x": torch.ones(1, 2, 64, dtype=BF16)}, RuntimeError),  # x must be (M, K)
        ({"x": torch.ones(0, 64, dtype=BF16)}, RuntimeError),  # empty
        ({"weight": torch.zeros(64, 8, dtype=FP16)}, RuntimeError),
        ({"weight": torch.zeros(63, 1, dtype=I32)}, RuntimeError),  # K mismatch
        ({"antiquant_scale": torch.ones(2, 8, dtype=FP16)}, RuntimeError),  # not x's dtype
        ({"antiquant_group_size": 48}, RuntimeError),  # not a multiple of 32
        ({"antiquant_group_size": 64}, RuntimeError),  # must be <= K - 1
        ({"antiquant_group_size": 0}, RuntimeError),  # (2, N) is no per-channel shape
        ({"antiquant_scale": torch.ones(3, 8, dtype=BF16)}, RuntimeError),  # ceil(K/g) = 2
        ({"antiquant_offset": torch.ones(1, 8, dtype=BF16)}, RuntimeError),  # shape of scale
        ({"antiquant_offset": torch.ones(2, 8, dtype=FP16)}, RuntimeError),  # dtype of scale
        ({"bias": torch.ones(8, dtype=BF16)}, RuntimeError),  # BF16 x takes an F32 bias
        ({"bias": torch.ones(9)}, RuntimeError),
        ({"inner_precise": 2}, RuntimeError),
        ({"quant_scale": torch.ones(8)}, NotImplementedError),
        ({"antiquant_scale": torch.ones(2, 8, dtype=torch.int64)}, NotImplementedError),
    ],
)
def test_wqbmm_rejects(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        _wq(**kwargs)


def test_wqbmm_k_and_n_limit() -> None:
    x = torch.ones(1, 65536, dtype=FP16)
    with pytest.raises(RuntimeError, match="65535"):
        npu_weight_quant_batchmatmul(x, torch.zeros(65536, 8, dtype=I8), torch.ones(8, dtype=FP16))
    x = torch.ones(1, 8, dtype=FP16)
    with pytest.raises(RuntimeError, match="65535"):
        npu_weight_quant_batchmatmul(x, torch.zeros(8, 8192, dtype=I32), torch.ones(1, dtype=FP16))
