"""compressed-tensors pack-quantized W4A16: golden bytes, reader/writer differential, round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import HetquantError, get_format
from hetquant.formats.ct_pack_quantized import CtPackQuantized

# --- independent re-implementations of compressed-tensors' pack / unpack -----------------------
# Written from reference/awq_ct.md §2.5 (compressed-tensors pack_to_int32 / unpack_from_int32,
# vllm-ascend w4a16.unpack_from_int32), deliberately not using hetquant's _bits helpers.


def ref_pack_to_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32`` (4 bits, packed_dim=1): ``value[:, i::8] << 4i``."""
    value = (q.to(torch.int8) + 8).to(torch.uint8).numpy().astype(np.uint32)
    packed = np.zeros((value.shape[0], value.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= value[:, i::8] << (4 * i)
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.int32))


def ref_unpack_from_int32(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """compressed-tensors ``unpack_from_int32``: ``(value >> 4i) & 0xF`` into ``[:, i::8]``, - 8."""
    out = torch.zeros(packed.shape[0], packed.shape[1] * 8, dtype=torch.int32)
    for i in range(8):
        out[:, i::8] = (packed >> (4 * i)) & 0xF
    return (out[:, : shape[1]] - 8).to(torch.int8)


def i32(word: int) -> int:
    """A 32-bit pattern written as unsigned hex → the int32 value safetensors stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


def exact_weight(gen: torch.Generator, n: int, k: int, g: int):
    """Random codes q [N,K] in -8..7, BF16 scales s [N,K/g] and W = q * s (exact in float32)."""
    q = torch.randint(-8, 8, (n, k), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.05 + 1e-3).bfloat16()
    return q, s, q.float() * s.float().repeat_interleave(g, 1)


FMT = CtPackQuantized()
FMT32 = CtPackQuantized(group_size=32)

# --- golden bytes ------------------------------------------------------------------------------


def test_golden_rtn_words():
    # Row 0: (k % 16) - 7.5 → absmax 7.5 → s = 7.5 / 7.5 = 1 (exact in BF16). round(w / s) with
    # ties to even gives -8 -6 -6 -4 -4 -2 -2 0 0 2 2 4 4 6 6 8→clamped 7; stored q + 8 is
    # 0 2 2 4 4 6 6 8 | 8 10 10 12 12 14 14 15. Input 8c + i sits at bits 4i of word c:
    # word 0 = 0x86644220, word 1 = 0xFEECCAA8. Row 1 is all zero: s clamps to eps = 2**-23,
    # q = 0, stored 8 → 0x88888888.
    w = torch.zeros(2, 32)
    w[0] = torch.arange(32) % 16 - 7.5
    got = FMT32.quantize(w)
    want = [[0x86644220, 0xFEECCAA8, 0x86644220, 0xFEECCAA8], [0x88888888] * 4]
    assert torch.equal(got["weight_packed"], torch.tensor([[i32(x) for x in r] for r in want]))
    assert got["weight_packed"].dtype == torch.int32
    assert got["weight_scale"].dtype == torch.bfloat16
    assert got["weight_scale"].float().tolist() == [[1.0], [2.0**-23]]
    assert got["weight_shape"].dtype == torch.int64 and got["weight_shape"].tolist() == [2, 32]
    deq = FMT32.dequantize(got)
    assert deq[0, :16].tolist() == [-8, -6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6, 7]
    assert torch.equal(deq[1], torch.zeros(32))


def test_golden_given_scales_words():
    # scales = 1: q = w. Row 0: codes 0..15 ascending, row 1 descending.
    w = torch.stack([torch.arange(32) % 16 - 8.0, 7.0 - torch.arange(32) % 16])
    got = FMT32.quantize(w, scales=torch.ones(2, 1))
    want = [[0x76543210, 0xFEDCBA98] * 2, [0x89ABCDEF, 0x01234567] * 2]
    assert got["weight_packed"].tolist() == [[i32(x) for x in r] for r in want]
    assert torch.equal(FMT32.dequantize(got), w)


# --- differential against compressed-tensors' own pack / unpack --------------------------------


@pytest.mark.parametrize("fmt", [FMT, FMT32], ids=["g128", "g32"])
@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (45, 384)])
def test_ct_reference_pack_unpack(fmt, shape):
    gen = torch.Generator().manual_seed(0)
    q, s, w = exact_weight(gen, *shape, fmt.group_size)
    stored = fmt.quantize(w, scales=s)
    assert torch.equal(stored["weight_packed"], ref_pack_to_int32(q))
    assert torch.equal(ref_unpack_from_int32(stored["weight_packed"], shape).long(), q)
    assert torch.equal(stored["weight_scale"], s)
    assert torch.equal(fmt.dequantize(stored), w)


def test_ct_reference_reads_rtn():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 256, generator=gen) * 0.02
    stored = FMT.quantize(w)
    q = ref_unpack_from_int32(stored["weight_packed"], (24, 256)).float()
    ref = q * stored["weight_scale"].float().repeat_interleave(128, 1)
    assert torch.equal(ref, FMT.dequantize(stored))


# --- round trips and the RTN bound ---------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 70),
    groups=st.integers(1, 3),
    g=st.sampled_from([32, 128]),
    seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip_exact(n, groups, g, seed):
    fmt = CtPackQuantized(group_size=g)
    k = g * groups
    _, s, w = exact_weight(torch.Generator().manual_seed(seed), n, k, g)
    stored = fmt.quantize(w, scales=s)
    fmt.check_stored(stored, (n, k))
    deq = fmt.dequantize(stored)
    assert torch.equal(deq, w)
    again = fmt.quantize(deq, scales=s)  # requantizing the dequantized weight is lossless
    for key in stored:
        assert torch.equal(again[key], stored[key]), key


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    groups=st.integers(1, 3),
    g=st.sampled_from([32, 128]),
    magnitude=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
    offset=st.sampled_from([0.0, 0.5, -3.0]),
    scale_dtype=st.sampled_from(["BF16", "F16", "F32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rtn_error_within_half_scale(n, groups, g, magnitude, offset, scale_dtype, seed):
    fmt = CtPackQuantized(group_size=g, scale_dtype=scale_dtype)
    k = g * groups
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) + offset) * magnitude
    w[0, :g] = 0.0  # an all-zero group
    stored = fmt.quantize(w)
    fmt.check_stored(stored, (n, k))
    s = stored["weight_scale"].double().repeat_interleave(g, dim=1)  # (N, K)
    err = (w.double() - fmt.dequantize(stored).double()).abs()
    # s / 2 exactly, up to float32 rounding of w / s inside quantize (|w / s| <= 8: ≤ 2**-21 s)
    assert bool((err <= s * (0.5 + 2.0**-20)).all())
    absmax = w.reshape(n, groups, g).abs().amax(-1).double()
    assert bool((stored["weight_scale"].double() >= absmax / 7.5).all())  # rounded up, not down


def test_quantize_does_not_mutate_input():
    w = torch.randn(4, 128)
    before = w.clone()
    FMT.quantize(w)
    assert torch.equal(w, before)


# --- shapes, dtypes, config, registry, refusals ------------------------------------------------


def test_stored_layout_kimi_expert():
    # Kimi-K2-Thinking expert gate_proj (7168 → 2048), group 32 (reference/awq_ct.md §2.7)
    metas = FMT32.stored((2048, 7168))
    assert {k: (m.dtype, m.shape) for k, m in metas.items()} == {
        "weight_packed": ("I32", (2048, 896)),
        "weight_scale": ("BF16", (2048, 224)),
        "weight_shape": ("I64", (2,)),
    }
    assert FMT.bits_per_weight((2048, 7168)) == pytest.approx(4 + 16 / 128, rel=1e-4)


def test_shape_dtype_i32_variant_reads_kimi_style_files():
    kimi = CtPackQuantized(group_size=32, shape_dtype="I32")
    stored = kimi.quantize(torch.randn(16, 64))
    assert stored["weight_shape"].dtype == torch.int32
    kimi.check_stored(stored, (16, 64))
    assert torch.equal(
        kimi.dequantize(stored),
        FMT32.dequantize(stored | {"weight_shape": stored["weight_shape"].long()}),
    )
    with pytest.raises(HetquantError, match="shape_dtype='I32'"):
        FMT32.dequantize(stored)  # the I64 default refuses an I32 weight_shape: pick the variant


def test_quantization_config():
    cfg = FMT32.quantization_config(ignore=["lm_head", "re:.*self_attn.*"])
    assert cfg == {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "dynamic": False,
                    "actorder": None,
                    "block_structure": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
    assert FMT.quantization_config()["config_groups"]["group_0"]["weights"]["group_size"] == 128
    json.dumps(cfg)


def test_registry_variants():
    assert get_format("ct_pack_quantized") == FMT
    assert get_format("ct_pack_quantized", group_size=32) == FMT32
    for bad in ({"group_size": 64}, {"scale_dtype": "F8_E4M3"}, {"shape_dtype": "I16"}):
        with pytest.raises(HetquantError, match="not supported"):
            get_format("ct_pack_quantized", **bad)


@pytest.mark.parametrize(
    ("shape", "match"),
    [((8, 100), "multiple of group_size"), ((0, 128), "positive"), ((8,), "2-D")],
)
def test_bad_shapes_refused(shape, match):
    with pytest.raises(HetquantError, match=match):
        FMT.stored(shape)
    with pytest.raises(HetquantError, match=match):
        FMT.quantize(torch.zeros(shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_refused(bad):
    w = torch.zeros(3, 128)
    w[1, 5] = bad
    with pytest.raises(HetquantError, match="NaN or Inf"):
        FMT.quantize(w)


def test_given_scales_checked():
    w = torch.zeros(3, 128)
    with pytest.raises(HetquantError, match="scales has shape"):
        FMT.quantize(w, scales=torch.ones(1, 3))
    with pytest.raises(HetquantError, match="finite and positive"):
        FMT.quantize(w, scales=torch.zeros(3, 1))
    with pytest.raises(HetquantError, match="finite and positive"):
        CtPackQuantized(scale_dtype="F16").quantize(w, scales=torch.full((3, 1), 1e6))


def test_dequantize_refuses_bad_tensors():
    stored = FMT.quantize(torch.randn(5, 256))
    with pytest.raises(HetquantError, match="asymmetric"):
        FMT.dequantize({**stored, "weight_zero_point": torch.zeros(1, 2, dtype=torch.int32)})
    with pytest.raises(HetquantError, match="weight_g_idx"):
        FMT.dequantize({**stored, "weight_g_idx": torch.zeros(256, dtype=torch.int32)})
    with pytest.raises(HetquantError, match="missing"):
        FMT.dequantize({k: v for k, v in stored.items() if k != "weight_shape"})
    with pytest.raises(HetquantError, match="integer tensor"):
        FMT.dequantize({**stored, "weight_shape": torch.tensor([5.0, 256.0])})
    with pytest.raises(HetquantError, match="weight_packed"):  # shape says 512 inputs, data has 256
        FMT.dequantize({**stored, "weight_shape": torch.tensor([5, 512])})
    with pytest.raises(HetquantError, match="multiple of group_size"):
        FMT.dequantize({**stored, "weight_shape": torch.tensor([5, 200])})
    bad = stored["weight_scale"].clone()
    bad[2, 1] = float("inf")
    with pytest.raises(HetquantError, match="NaN or Inf"):
        FMT.dequantize({**stored, "weight_scale": bad})
