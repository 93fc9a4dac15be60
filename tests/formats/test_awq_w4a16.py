"""AutoAWQ GEMM W4A16: golden bytes, AutoAWQ-unpack differential, round trips, RTN bound, errors."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import HetquantError, get_format
from hetquant.formats.awq_w4a16 import AwqW4A16

# --- an independent re-implementation of AutoAWQ's reader ---------------------------------------
# Written from reference/awq_ct.md §1.2 (AutoAWQ awq/utils/packing_utils.py: unpack_awq,
# reverse_awq_order, dequantize_gemm), deliberately not using hetquant's _bits helpers.

REF_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def ref_unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ ``unpack_awq``: shift each word right by 0, 4, …, 28 (columnwise)."""
    shifts = torch.arange(0, 32, 4)
    iw = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iz = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    return iw.view(iw.shape[0], -1), iz.view(iz.shape[0], -1)


def ref_reverse_awq_order(iw: torch.Tensor, iz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ ``reverse_awq_order``: gather columns with AWQ_REVERSE_ORDER per block of 8."""
    idx = torch.arange(iz.shape[-1], dtype=torch.int32).view(-1, 8)[:, REF_REVERSE_ORDER].view(-1)
    return iw[:, idx], iz[:, idx]


def ref_codes(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned codes as AutoAWQ sees them: q [K, N], z [K/g, N] (the ``& 0xF`` overflow check)."""
    iw, iz = ref_reverse_awq_order(*ref_unpack_awq(qweight, qzeros))
    return torch.bitwise_and(iw, 0xF), torch.bitwise_and(iz, 0xF)


def ref_codes_direct_shift(qweight: torch.Tensor) -> torch.Tensor:
    """vLLM's triton AWQ reader: element j of each 8 is ``(word >> 4*REVERSE[j]) & 0xF``."""
    shifts = torch.tensor(REF_REVERSE_ORDER) * 4
    w = qweight.to(torch.int64)[:, :, None]  # (K, N/8, 1)
    return ((w >> shifts) & 0xF).reshape(qweight.shape[0], -1)  # (K, N)


def ref_dequantize_gemm(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AutoAWQ ``dequantize_gemm`` in float32 → [K, N] (AutoAWQ's orientation)."""
    iw, iz = ref_codes(qweight, qzeros)
    s = scales.float().repeat_interleave(group_size, dim=0)
    iz = iz.repeat_interleave(group_size, dim=0)
    return (iw.float() - iz.float()) * s


def i32(word: int) -> int:
    """A 32-bit pattern written as unsigned hex → the int32 value safetensors stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


def exact_weight(gen: torch.Generator, n: int, k: int, g: int):
    """Random codes q [N,K], zeros z [N,K/g], FP16 scales s [N,K/g] and W = (q - z) * s, exact."""
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, 16, (n, k // g), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.05 + 1e-3).half()
    w = (q - z.repeat_interleave(g, 1)).float() * s.float().repeat_interleave(g, 1)
    return q, z, s, w


FMT = AwqW4A16()
FMT64 = AwqW4A16(group_size=64)

# --- golden bytes ------------------------------------------------------------------------------


def test_golden_interleaved_words():
    # W[n, k] = ((n + k) % 16) - 8 over [8, 64], g = 64: every row spans -8..7, so the RTN
    # parameters are s = 15 / 15 = 1 and z = -round(-8 / 1) = 8, and q[n, k] = (n + k) % 16.
    n_idx = torch.arange(8)[:, None]
    k_idx = torch.arange(64)[None, :]
    w = ((n_idx + k_idx) % 16 - 8).float()
    got = FMT64.quantize(w)
    # Word for input k: bits 4i..4i+3 hold output AWQ_ORDER[i] = (0,2,4,6,1,3,5,7)[i], so the
    # nibbles from low to high are q[0,k] q[2,k] q[4,k] q[6,k] q[1,k] q[3,k] q[5,k] q[7,k].
    # k = 0: 0 2 4 6 1 3 5 7 → 0x75316420; each later k adds 1 to every nibble (mod 16).
    words_k0_to_15 = [
        0x75316420, 0x86427531, 0x97538642, 0xA8649753,
        0xB975A864, 0xCA86B975, 0xDB97CA86, 0xECA8DB97,
        0xFDB9ECA8, 0x0ECAFDB9, 0x1FDB0ECA, 0x20EC1FDB,
        0x31FD20EC, 0x420E31FD, 0x531F420E, 0x6420531F,
    ]  # fmt: skip
    want_qweight = torch.tensor([[i32(wd)] for wd in words_k0_to_15 * 4], dtype=torch.int32)
    assert torch.equal(got["qweight"], want_qweight)
    assert torch.equal(got["qzeros"], torch.tensor([[i32(0x88888888)]], dtype=torch.int32))
    assert torch.equal(got["scales"], torch.ones(1, 8, dtype=torch.float16))
    assert torch.equal(FMT64.dequantize(got), w)


def test_golden_rtn_params_and_slot():
    # Only output row 1 is non-zero: -0.75, 3.0, 1.1, -0.3, then zeros. Range 3.75 → s = 0.25
    # (exact in FP16), z = -round(-0.75 / 0.25) = 3; codes round(w / s) + z = 0, 15, 7, 2, 3, ….
    # Output 1 sits in nibble 4 (bits 16..19). All-zero rows: range clamps to 1e-5, s = 1e-5/15
    # = 6.67e-7 rounded up to the FP16 subnormal 12 * 2**-24; z = 0, codes 0.
    w = torch.zeros(8, 64)
    w[1, :4] = torch.tensor([-0.75, 3.0, 1.1, -0.3])
    got = FMT64.quantize(w)
    want_qweight = [0x00000000, 0x000F0000, 0x00070000, 0x00020000] + [0x00030000] * 60
    assert got["qweight"].flatten().tolist() == want_qweight
    assert got["qzeros"].tolist() == [[0x00030000]]
    tiny = 12 * 2.0**-24
    assert got["scales"].float().tolist() == [[tiny, 0.25] + [tiny] * 6]
    want_row1 = torch.zeros(64)
    want_row1[:4] = torch.tensor([-0.75, 3.0, 1.0, -0.25])
    deq = FMT64.dequantize(got)
    assert torch.equal(deq[1], want_row1)
    assert torch.equal(deq[[0, 2, 3, 4, 5, 6, 7]], torch.zeros(7, 64))


# --- differential against the AutoAWQ reader ----------------------------------------------------


@pytest.mark.parametrize("fmt", [FMT, FMT64], ids=["g128", "g64"])
@pytest.mark.parametrize("shape", [(8, 128), (72, 256), (24, 384)])
def test_autoawq_reader_reads_our_bytes(fmt, shape):
    gen = torch.Generator().manual_seed(0)
    n, k = shape
    q, z, s, w = exact_weight(gen, n, k, fmt.group_size)
    stored = fmt.quantize_with(w, s, z)
    iw, iz = ref_codes(stored["qweight"], stored["qzeros"])
    assert torch.equal(iw.long(), q.t())  # AutoAWQ's intweight is [in, out]
    assert torch.equal(iz.long(), z.t())
    assert torch.equal(ref_codes_direct_shift(stored["qweight"]), q.t())
    assert torch.equal(stored["scales"], s.t())
    ref = ref_dequantize_gemm(stored["qweight"], stored["qzeros"], stored["scales"], fmt.group_size)
    assert torch.equal(ref.t(), w)
    assert torch.equal(fmt.dequantize(stored), w)


def test_autoawq_reader_agrees_after_rtn():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen) * 0.02
    stored = FMT.quantize(w)
    ref = ref_dequantize_gemm(stored["qweight"], stored["qzeros"], stored["scales"], 128)
    assert torch.equal(ref.t(), FMT.dequantize(stored))


# --- round trips ---------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    n8=st.integers(1, 12),
    groups=st.integers(1, 3),
    g=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip_exact(n8, groups, g, seed):
    fmt = AwqW4A16(group_size=g)
    n, k = 8 * n8, g * groups
    _, z, s, w = exact_weight(torch.Generator().manual_seed(seed), n, k, g)
    stored = fmt.quantize_with(w, s, z)
    fmt.check_stored(stored, (n, k))
    deq = fmt.dequantize(stored)
    assert torch.equal(deq, w)
    again = fmt.quantize(deq, scales=s, zeros=z)  # requantizing the dequantized weight is lossless
    for key in stored:
        assert torch.equal(again[key], stored[key]), key


@settings(max_examples=25, deadline=None)
@given(
    n8=st.integers(1, 10),
    groups=st.integers(1, 3),
    g=st.sampled_from([64, 128]),
    magnitude=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
    offset=st.sampled_from([0.0, 0.5, -3.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rtn_error_within_half_scale(n8, groups, g, magnitude, offset, seed):
    fmt = AwqW4A16(group_size=g)
    n, k = 8 * n8, g * groups
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) + offset) * magnitude  # offset → one-sided groups too
    w[0, :g] = 0.0  # an all-zero group
    stored = fmt.quantize(w)
    fmt.check_stored(stored, (n, k))
    s = stored["scales"].double().t().repeat_interleave(g, dim=1)  # (N, K)
    err = (w.double() - fmt.dequantize(stored).double()).abs()
    # s / 2 exactly, up to float32 rounding of w / s inside quantize (|w / s| <= 16: ≤ 2**-20 s)
    assert bool((err <= s * (0.5 + 2.0**-19)).all())


def test_rtn_scale_is_smallest_fp16_covering_the_range():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 256, generator=gen)
    stored = FMT.quantize(w)
    grouped = w.reshape(16, 2, 128)
    lo = grouped.amin(-1).clamp(max=0)
    hi = grouped.amax(-1).clamp(min=0)
    need = (hi.double() - lo.double()) / 15  # (16, 2)
    s16 = stored["scales"].t()  # (16, 2)
    below = torch.nextafter(s16, torch.zeros_like(s16))
    assert bool((s16.double() >= need).all()) and bool((below.double() < need).all())
    z = torch.bitwise_and(ref_codes(stored["qweight"], stored["qzeros"])[1], 0xF).t()
    assert torch.equal(z.float(), -torch.round(lo / s16.float()))  # AutoAWQ's zero formula


def test_quantize_does_not_mutate_input():
    w = torch.randn(8, 128)
    before = w.clone()
    FMT.quantize(w)
    assert torch.equal(w, before)


# --- shapes, config, registry, refusals -------------------------------------------------------


def test_stored_layout_and_bits():
    metas = FMT64.stored((2048, 7168))  # DeepSeek expert gate_proj, reference/awq_ct.md §1.2
    assert {k: (m.dtype, m.shape) for k, m in metas.items()} == {
        "qweight": ("I32", (7168, 256)),
        "qzeros": ("I32", (112, 256)),
        "scales": ("F16", (112, 2048)),
    }
    assert FMT.stored((576, 7168))["qweight"].shape == (7168, 72)  # kv_a_proj_with_mqa
    assert FMT.bits_per_weight((2048, 7168)) == pytest.approx(4 + 16 / 128 + 4 / 128)


def test_quantization_config():
    cfg = FMT.quantization_config()
    assert cfg == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": 128,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    cfg64 = FMT64.quantization_config(("gate", "kv_b_proj"))
    assert cfg64["group_size"] == 64 and cfg64["modules_to_not_convert"] == ["gate", "kv_b_proj"]
    json.dumps(cfg64)


def test_registry_variants():
    assert get_format("awq_w4a16") == FMT
    assert get_format("awq_w4a16", group_size=64) == FMT64
    with pytest.raises(HetquantError, match="group_size 32"):
        get_format("awq_w4a16", group_size=32)


@pytest.mark.parametrize(
    ("shape", "match"),
    [((12, 128), "multiple of 8"), ((8, 100), "not divisible by group_size"), ((8,), "2-D")],
)
def test_bad_shapes_refused(shape, match):
    with pytest.raises(HetquantError, match=match):
        FMT.stored(shape)
    with pytest.raises(HetquantError, match=match):
        FMT.quantize(torch.zeros(shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_refused(bad):
    w = torch.zeros(8, 128)
    w[3, 7] = bad
    with pytest.raises(HetquantError, match="NaN or Inf"):
        FMT.quantize(w)


def test_huge_weight_refused():
    w = torch.zeros(8, 128)
    w[0, 0] = 1e7  # range / 15 overflows FP16
    with pytest.raises(HetquantError, match="FP16"):
        FMT.quantize(w)


def test_quantize_with_checks():
    w = torch.zeros(8, 128)
    s = torch.ones(8, 1)
    z = torch.full((8, 1), 8)
    with pytest.raises(HetquantError, match="scales has shape"):
        FMT.quantize_with(w, s.t(), z)
    with pytest.raises(HetquantError, match="finite and positive"):
        FMT.quantize_with(w, -s, z)
    with pytest.raises(HetquantError, match="overflow FP16"):
        FMT.quantize_with(w, s * 1e6, z)
    with pytest.raises(HetquantError, match=r"integers in 0\.\.15"):
        FMT.quantize_with(w, s, z + 8)
    with pytest.raises(HetquantError, match=r"integers in 0\.\.15"):
        FMT.quantize_with(w, s, z + 0.5)
    with pytest.raises(HetquantError, match="both scales= and zeros="):
        FMT.quantize(w, scales=s)


def test_dequantize_refuses_bad_tensors():
    stored = FMT.quantize(torch.randn(16, 256))
    with pytest.raises(HetquantError, match="missing"):
        FMT.dequantize({k: v for k, v in stored.items() if k != "scales"})
    with pytest.raises(HetquantError, match="qzeros"):
        FMT.dequantize({**stored, "qzeros": stored["qzeros"][:1]})
    with pytest.raises(HetquantError, match="scales"):
        FMT.dequantize({**stored, "scales": stored["scales"].float()})
    with pytest.raises(HetquantError, match="qzeros"):
        FMT64.dequantize(stored)  # g128 tensors read as g64: qzeros/scales have the wrong rows
    bad = stored["scales"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(HetquantError, match="NaN or Inf"):
        FMT.dequantize({**stored, "scales": bad})
