"""Tests of formats/w8a8_npu_ops.py: the reference NPU ops (npu_dynamic_quant, the dynamic and
static quant matmuls) against hand-computed goldens and the dequantized weights, and refused
inputs.

Golden values below are computed by hand (see the comments), never by the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ascend_cases import ACT_MAX, ACT_MIN, GOLDEN_W, UNIT_ROUNDOFF, bf16_weights

from hetquant.formats import HetquantError, get_format
from hetquant.formats import w8a8_npu_ops as ops

DYN = get_format("w8a8_dynamic")
STATIC = get_format("w8a8")


def test_static_golden_matmul() -> None:
    # x / 0.09375 = 16, -8, 0, 32, 1 -> x_q = those - 43; (x_q + 43) . q[n] * deq_scale[n]:
    # row 0: 2032 + 512 + 64 - 2 = 2606 * 0.09375;  row 1: 2032 - 64 + 50 = 2018 * 0.1875
    # row 3: 2032 - 4064 = -2032 * 0.005859375
    t = STATIC.quantize(GOLDEN_W, act_min=ACT_MIN, act_max=ACT_MAX)
    x = torch.tensor([[1.5, -0.75, 0.0, 3.0, 0.09375]])
    y = ops.static_quant_matmul(x, t)
    assert torch.equal(y, torch.tensor([[244.3125, 378.375, 0.0, -11.90625]]))


def test_dynamic_quant_golden() -> None:
    # row 0: 127 / 1 = 127 -> 127, -63.5 -> -64 (tie to even), 31.75 -> 32; row 1 is all zero
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    x_q, x_scale = ops.dynamic_quant(x)
    assert x_q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0]]
    assert x_scale.dtype == torch.float32
    assert x_scale.tolist() == [float(np.float32(1 / 127)), 0.0]  # 1 / (127 / 1) in F32


def _dequant_bound(x_hat, w_hat, step, unit) -> torch.Tensor:
    """Bound on |x @ w_hat.T - y| for y = the int8 op, x_hat its dequantized activations.

    |x - x_hat| <= step/2 per element (step = activation scale; (1 + 2^-20) covers F32 rounding
    of x * (1/step)), so the activation-quantization error is <= step/2 * sum_k |w_hat[n, k]|.
    The op computes x_hat @ w_hat.T exactly in integers and then rounds: int32 -> F32, two F32
    multiplies and the cast to the output dtype, <= (unit + 2^-21) * sum_k |x_hat| |w_hat|.
    """
    act = 0.5 * step * (1 + 2.0**-20) * w_hat.abs().sum(1)  # (m, 1) * (n,) -> (m, n)
    return act + (unit + 2.0**-21) * (x_hat.abs() @ w_hat.abs().T)  # (m, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_dynamic_matmul_vs_dequantize(dtype: torch.dtype, param_dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(33, 70, generator=gen) * torch.logspace(-3, 1, 70)  # uneven columns
    t = DYN.quantize(weight)
    x = (torch.randn(2, 9, 70, generator=gen) * 5).to(dtype)
    x[0, 3] = 0.0  # an all-zero token
    y = ops.dynamic_quant_matmul(x, t, param_dtype=param_dtype)
    assert y.dtype == dtype and y.shape == (2, 9, 33)
    w_hat = DYN.dequantize(t).double()  # (n, k)
    x2 = x.reshape(-1, 70).double()  # (m, k)
    x_q, x_scale = ops.dynamic_quant(x.reshape(-1, 70))
    x_hat = x_q.double() * x_scale.double()[:, None]  # (m, k)
    unit = UNIT_ROUNDOFF[dtype] + (2.0**-8 if param_dtype is not None else 0.0)
    bound = _dequant_bound(x_hat, w_hat, x_scale.double()[:, None], unit)
    err = (x2 @ w_hat.T - y.reshape(-1, 33).double()).abs()
    assert (err <= bound).all()
    assert not y[0, 3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_matmul_vs_dequantize(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(21, 48, generator=gen)
    x = (torch.rand(12, 48, generator=gen) * 6 - 1.5).to(dtype)  # inside the calibrated range
    t = STATIC.quantize(weight, act_min=x.min(), act_max=x.max())
    y = ops.static_quant_matmul(x, t)
    s_x, z_x = t["input_scale"].double(), t["input_offset"].double()
    x_q = torch.round(x.double() / s_x + z_x).clamp(-128, 127)  # (m, k)
    x_hat = (x_q - z_x) * s_x  # (m, k)
    w_hat = STATIC.dequantize(t).double()
    bound = _dequant_bound(x_hat, w_hat, s_x, UNIT_ROUNDOFF[dtype])
    assert ((x.double() @ w_hat.T - y.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm_ascend_bf16_scale_load_changes_nothing(dtype: torch.dtype) -> None:
    """vllm-ascend copies weight_scale into a BF16 parameter: bit-identical output to F32."""
    t = DYN.quantize(bf16_weights(4).float())
    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    held = ops.dynamic_quant_matmul(x, t, param_dtype=torch.bfloat16)
    assert torch.equal(held, ops.dynamic_quant_matmul(x, t))


def test_bad_inputs_refused() -> None:
    t = DYN.quantize(torch.ones(3, 4))
    with pytest.raises(HetquantError, match=r"x \[\.\.\., 5\] does not match weight \[3, 4\]"):
        ops.dynamic_quant_matmul(torch.ones(2, 5), t)
    with pytest.raises(HetquantError, match="NaN/Inf"):
        ops.dynamic_quant_matmul(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), t)
    wide = DYN.quantize(torch.ones(1, 65536))
    with pytest.raises(HetquantError, match="65535"):
        ops.dynamic_quant_matmul(torch.ones(1, 65536), wide)
