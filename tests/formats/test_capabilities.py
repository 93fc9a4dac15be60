"""Capabilities are declared on the format base classes (``formats/base.py``): a format sets a
flag exactly where it overrides the method, so callers read the flag and never probe with
``hasattr``."""

from __future__ import annotations

import pytest

from hetquant.formats import EXPERT_FORMATS, FORMATS, ExpertLayerFormat, WeightFormat

_LINEAR = {"native_quantize": "quantize_array", "native_source": "source_row_arrays"}
_EXPERT = {"streams_rows": "quantize_rows", "native_rows": "quantize_rows_array"}


def _overrides(fmt: object, base: type, method: str) -> bool:
    return getattr(type(fmt), method) is not getattr(base, method)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_weight_format_flags_match_their_methods(name: str) -> None:
    fmt = FORMATS[name]
    for flag, method in _LINEAR.items():
        assert getattr(fmt, flag) == _overrides(fmt, WeightFormat, method), (name, flag)


@pytest.mark.parametrize("name", sorted(EXPERT_FORMATS))
def test_expert_format_flags_match_their_methods(name: str) -> None:
    fmt = EXPERT_FORMATS[name]
    for flag, method in _EXPERT.items():
        assert getattr(fmt, flag) == _overrides(fmt, ExpertLayerFormat, method), (name, flag)


def test_an_undeclared_capability_raises_naming_the_format() -> None:
    with pytest.raises(NotImplementedError, match="'fp8_block' has no native quantize_array"):
        FORMATS["fp8_block"].quantize_array(None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="'fp4_cpu_experts' does not stream rows"):
        EXPERT_FORMATS["fp4_cpu_experts"].quantize_rows(None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="'fp4_cpu_experts' has no native rows"):
        EXPERT_FORMATS["fp4_cpu_experts"].quantize_rows_array(None)  # type: ignore[arg-type]


def test_every_expert_layout_reads_back_from_its_header() -> None:
    """``from_stored`` is abstract: every registered layout can be identified by the pool."""
    for name, fmt in EXPERT_FORMATS.items():
        metas = fmt.stored(4, 256, 128)
        variant, dims = fmt.from_stored(metas)
        assert dims == (4, 256, 128) and variant.stored(*dims) == metas, name
