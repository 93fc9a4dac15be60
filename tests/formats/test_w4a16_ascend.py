"""The W4A16 experts of ``ascend-w4a16``: the ``ct_pack_quantized`` variant vllm-ascend's W4A16 MoE
scheme reads (int32 ``weight_shape``), golden bytes on disk and after vllm-ascend's load-time
repack (re-implemented from ``methods/w4a16.py:35-108, 332-364``), and the lossless repack of a
Kimi K2 Thinking source (``formats/linear_repack.py``)."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError, get_format
from hetquant.formats.linear_repack import LINEAR_REPACKS

ASCEND = get_format("ct_pack_quantized", group_size=32, shape_dtype="I32")  # what the recipe writes
REPACK = LINEAR_REPACKS["ct_pack_quantized", "ct_pack_quantized"]


def i32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def golden_weight() -> torch.Tensor:
    """q[n, k] = (n + k) % 16 - 8 with scale 1: every code, shifted per row. [8, 32]."""
    n, k = torch.meshgrid(torch.arange(8), torch.arange(32), indexing="ij")
    return ((n + k) % 16 - 8).float()


def test_golden_bytes_on_disk() -> None:
    # stored nibble i of word [n, c] = q[n, 8c + i] + 8 = (n + 8c + i) % 16: word [0, 0] holds
    # 0..7 → 0x76543210, [0, 1] 8..15 → 0xFEDCBA98, [1, 0] 1..8 → 0x87654321
    t = ASCEND.quantize(golden_weight(), scales=torch.ones(8, 1))
    assert t["weight_packed"][:2, :2].tolist() == [
        [i32(0x76543210), i32(0xFEDCBA98)],
        [i32(0x87654321), i32(0x0FEDCBA9)],
    ]
    assert t["weight_shape"].dtype == torch.int32
    assert t["weight_shape"].numpy().tobytes() == bytes.fromhex("0800000020000000")
    assert t["weight_scale"].dtype == torch.bfloat16 and t["weight_scale"].shape == (8, 1)
    assert torch.equal(ASCEND.dequantize(t), golden_weight())


# --- vllm-ascend's W4A16 load (methods/w4a16.py), written from its source -----------------------


def ref_unpack_from_int32(w: torch.Tensor, k: int) -> torch.Tensor:
    """``unpack_from_int32`` (packed_dim=1): element i of a word from bits 4i, minus 8."""
    out = torch.zeros(w.shape[0], w.shape[1] * 8, dtype=torch.int32)
    for i in range(8):
        out[:, i::8] = (w >> (4 * i)) & 0xF
    return (out[:, :k] - 8).to(torch.int8)


def ref_int4pack(w: torch.Tensor) -> torch.Tensor:
    """``npu_convert_weight_to_int4pack`` on int32 [K, N]: 8 consecutive last-dim elements per
    word, element j in nibble j, two's complement (reference §3)."""
    nib = (w & 0xF).to(torch.int64).reshape(w.shape[0], -1, 8)
    word = sum(nib[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def test_golden_bytes_after_vllm_ascend_repack() -> None:
    """process_weights_after_loading: unpack, transpose to [K, N], int4pack → [K, N/8]. Word [k, 0]
    nibble j = q[j, k] & 0xF = (j + k + 8) % 16: k = 0 → 0xFEDCBA98, k = 1 → 0x0FEDCBA9."""
    t = ASCEND.quantize(golden_weight(), scales=torch.ones(8, 1))
    q = ref_unpack_from_int32(t["weight_packed"], 32)  # (N, K)
    assert torch.equal(q.float(), golden_weight())
    packed = ref_int4pack(q.T.contiguous().int())  # (K, N/8)
    assert packed.shape == (32, 1)
    assert packed[:3, 0].tolist() == [i32(0xFEDCBA98), i32(0x0FEDCBA9), i32(0x10FEDCBA)]
    scale = t["weight_scale"].T  # (K/g, N): the antiquant scale, offsets synthesized as zeros
    assert scale.shape == (1, 8)


def test_repack_keeps_codes_and_scales() -> None:
    """A K2 Thinking expert (group 32, BF16 scales; I64 or I32 weight_shape) into the recipe's
    variant: the same words and scales; weight_shape in int32."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for shape_dtype in ("I64", "I32"):
        src_fmt = get_format("ct_pack_quantized", group_size=32, shape_dtype=shape_dtype)
        src = src_fmt.quantize(w)
        assert REPACK.holds(src_fmt, ASCEND) is None
        out = REPACK.repack(src, ASCEND)
        ASCEND.check_stored(out, (16, 64))
        assert (
            out["weight_packed"] is src["weight_packed"]
            and out["weight_scale"] is src["weight_scale"]
        )
        assert out["weight_shape"].tolist() == [16, 64]
        assert torch.equal(ASCEND.dequantize(out), src_fmt.dequantize(src))


def test_repack_refuses_what_it_cannot_keep() -> None:
    g128 = get_format("ct_pack_quantized", group_size=128)
    assert REPACK.holds(g128, ASCEND) == (
        "the source's group 128 with BF16 scales does not fit group 32 with BF16 scales"
    )
    f32 = get_format("ct_pack_quantized", group_size=32, scale_dtype="F32")
    assert "F32 scales" in REPACK.holds(f32, ASCEND)
    t = ASCEND.quantize(torch.randn(8, 32))
    with pytest.raises(HetquantError, match="weight_zero_point present"):
        REPACK.repack({**t, "weight_zero_point": torch.zeros(8, 1)}, ASCEND)
    bad = t["weight_scale"].clone()
    bad[3, 0] = float("nan")
    with pytest.raises(HetquantError, match="NaN or Inf"):
        REPACK.repack({**t, "weight_scale": bad}, ASCEND)
