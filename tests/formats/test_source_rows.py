"""formats/source_rows.py: every format read as a conversion source — ``source_rows`` streams
exactly ``bf16(dequantize)`` in row blocks, ``source_absmax`` and ``source_dequantized`` agree with
it, corrupt FP8 sources are refused — and the chunking and NaN/Inf checks behind them."""

from __future__ import annotations

import math

import pytest
import torch

from hetquant.formats import FORMATS, HetquantError, get_format, source_rows

SHAPE = (520, 256)  # 520 rows: a partial FP8 block row, several streamed chunks


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g) * 0.02


@pytest.mark.parametrize("name", sorted(set(FORMATS) - {"nvfp4_ascend"}))
@pytest.mark.parametrize("chunk_bytes", [2 * 256 * 48, 8 << 20])  # 48 rows; the default
def test_source_rows_stream_the_exact_dequantization(
    name: str, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source_rows, "SOURCE_CHUNK_BYTES", chunk_bytes)
    fmt = get_format(name)
    opts = {"act_min": -1.0, "act_max": 2.0} if name == "w8a8" else {}  # static: needs a range
    stored = fmt.quantize(_weight(), **opts)
    want = fmt.dequantize(stored).to(torch.bfloat16)
    rows = list(fmt.source_rows("m", stored, SHAPE))
    assert [r for r, _ in rows] == sorted({r for r, _ in rows}) and rows[0][0] == 0
    got = torch.cat([t for _, t in rows])
    assert got.dtype == torch.bfloat16 and torch.equal(
        got.view(torch.int16), want.view(torch.int16)
    )
    assert fmt.source_absmax("m", stored, SHAPE) == float(want.abs().amax())
    if chunk_bytes < 8 << 20 and name in {"ct_pack_quantized", "int4_cpu", "w8a8_dynamic"}:
        assert len(rows) > 1  # formats stored by rows really stream


def test_tiled_fp4_source_reads_whole() -> None:
    fmt = get_format("nvfp4_ascend")
    stored = fmt.quantize(torch.randn(256, 64) * 0.02)
    rows = list(fmt.source_rows("m", stored, (256, 64)))
    assert len(rows) == 1 and torch.equal(rows[0][1], fmt.dequantize(stored).to(torch.bfloat16))


def _fp8(scale_value: float) -> dict[str, torch.Tensor]:
    stored = get_format("fp8_block").quantize(_weight())
    stored["weight_scale_inv"] = stored["weight_scale_inv"].clone()
    stored["weight_scale_inv"][2, 1] = scale_value
    return stored


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (math.nan, r"m\.weight_scale_inv: 1 NaN/Inf"),
        (math.inf, r"m\.weight_scale_inv: 1 NaN/Inf"),
        (-1e-3, r"m\.weight_scale_inv: negative scale -0\.001"),
        (3e38, r"m\.weight_scale_inv: scale 3e\+38 makes 448·s overflow BF16"),
    ],
)
def test_corrupt_fp8_scales_are_refused(value: float, needle: str) -> None:
    fmt = get_format("fp8_block")
    stored = _fp8(value)
    with pytest.raises(HetquantError, match=needle):
        list(fmt.source_rows("m", stored, SHAPE))
    with pytest.raises(HetquantError, match=needle):
        fmt.source_absmax("m", stored, SHAPE)


def test_fp8_nan_code_is_refused_in_its_block_row() -> None:
    fmt = get_format("fp8_block")
    stored = _fp8(1e-3)
    stored["weight"] = stored["weight"].clone()
    stored["weight"].view(torch.uint8)[300, 7] = 0x7F
    rows = fmt.source_rows("m", stored, SHAPE)
    assert [r for r, _ in zip(range(2), rows, strict=False)] == [0, 1]  # blocks 0, 1 are fine
    with pytest.raises(HetquantError, match=r"m\.weight: NaN code"):
        list(fmt.source_rows("m", stored, SHAPE))


def test_nan_in_a_streamed_source_names_the_module() -> None:
    fmt = get_format("int4_cpu")
    stored = fmt.quantize(_weight())
    stored["weight_scale"] = stored["weight_scale"].clone()
    stored["weight_scale"][9] = math.inf
    with pytest.raises(HetquantError, match=r"^mod: int4_cpu: a scale is NaN/Inf"):
        list(fmt.source_rows("mod", stored, SHAPE))


def test_source_dequantized_assembles_the_streamed_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_rows, "SOURCE_CHUNK_BYTES", 2 * 256 * 48)  # 48 rows
    fmt = get_format("int4_cpu")
    stored = fmt.quantize(_weight())
    assert len(list(fmt.source_rows("m", stored, SHAPE))) == math.ceil(SHAPE[0] / 48)
    whole = fmt.source_dequantized("m", stored, SHAPE)
    assert torch.equal(whole, fmt.dequantize(stored).to(torch.bfloat16))


def test_row_step_chunks_row_stored_formats_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_rows, "SOURCE_CHUNK_BYTES", 2 * 256 * 48)
    step, keys = source_rows.row_step(get_format("int4_cpu"), SHAPE)
    assert (step, keys) == (48, frozenset({"weight_packed", "weight_scale"}))
    tiled = get_format("nvfp4_ascend")  # a tiling: its shard view is not the stored shapes
    assert source_rows.row_step(tiled, (256, 64)) == (256, frozenset())


def test_float_rows_are_checked_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_rows, "SOURCE_CHUNK_BYTES", 64 * 4 * 30)  # 30 F32 rows of 64
    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(3))
    chunks = list(source_rows.float_rows("m", w))
    assert [r for r, _ in chunks] == [0, 30, 60, 90]
    assert torch.equal(torch.cat([c for _, c in chunks]), w)
    w[70, 5] = math.nan
    rows = source_rows.float_rows("m", w)
    assert [next(rows)[0], next(rows)[0]] == [0, 30]  # chunks before the NaN are fine
    with pytest.raises(
        HetquantError, match=r"^m: 1 NaN/Inf value\(s\) in the source; the checkpoint"
    ):
        next(rows)


def test_finiteness_checks() -> None:
    assert source_rows.all_finite(torch.empty(0, 4))
    assert source_rows.all_finite(torch.ones(3, 4, dtype=torch.bfloat16))
    assert not source_rows.all_finite(torch.tensor([1.0, -math.inf]).bfloat16())
    source_rows.check_finite("m", torch.full((2,), 0x7F, dtype=torch.uint8))  # codes: not checked
    with pytest.raises(HetquantError, match=r"^m: 2 NaN/Inf value\(s\) in the dequantized weight"):
        source_rows.check_finite("m", torch.tensor([math.nan, math.inf, 1.0]), "dequantized weight")
