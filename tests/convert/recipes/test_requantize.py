"""convert/recipes/requantize.py: format densities, the refusal of a low-bit source re-quantized
to another low-bit format (and what passes: --requantize, lossless repacks, high-bit sources or
targets), and a linear repack whose parameters do not hold the source's codes."""

from __future__ import annotations

import pytest
from support import TINY

from hetquant.convert import SourceCheckpoint, get_recipe
from hetquant.convert.recipes import Target, quantized
from hetquant.convert.recipes.requantize import (
    LOW_BITS,
    check_repack,
    check_requantize,
    density,
    registered,
)
from hetquant.formats import EXPERT_FORMATS, FORMATS, HetquantError

EXPERT = "model.layers.1.mlp.experts.0.gate_proj.weight"


@pytest.fixture(scope="module")
def role():
    return SourceCheckpoint.open(TINY).tensors[EXPERT].role


def test_density_of_linear_and_expert_formats() -> None:
    assert density(FORMATS["int4_cpu"]) == 4 + 32 / 1024  # one F32 scale per 1024-wide row
    assert density(FORMATS["bf16"]) == 16.0
    assert density(EXPERT_FORMATS["int4_cpu_experts"]) == 4.0625  # gate/up rows of 1024, down 256
    assert density(None) is None
    assert density(FORMATS["w8a8_dynamic"]) > LOW_BITS > density(FORMATS["awq_w4a16"])


def test_registered_names_linear_and_expert_formats() -> None:
    assert registered("int4_cpu") is FORMATS["int4_cpu"]
    assert registered("int4_cpu_group_experts") is EXPERT_FORMATS["int4_cpu_group_experts"]
    assert registered("plain") is None


def test_low_bit_to_low_bit_is_refused_unless_asked(role) -> None:
    awq = get_recipe("awq-w4a16")
    target = Target.writing(FORMATS["awq_w4a16"])
    with pytest.raises(HetquantError, match=r"int4_cpu, a low-bit format; recipe awq-w4a16 would"):
        check_requantize(awq, role, "int4_cpu", target)
    check_requantize(awq.with_options({"requantize": True}), role, "int4_cpu", target)
    check_requantize(awq, role, "awq_w4a16", target)  # the same format: not re-quantized
    check_requantize(awq, role, "fp8_block", target)  # a high-bit source
    check_requantize(awq, role, "plain", target)  # not a format
    check_requantize(awq, role, "int4_cpu", Target.writing(FORMATS["w8a8_dynamic"]))  # high-bit
    repack = Target.writing(EXPERT_FORMATS["int4_cpu_group_experts"])
    check_requantize(awq, role, "ct_pack_quantized", repack)  # codes and scales kept


def test_linear_repack_that_cannot_hold_the_codes_is_refused() -> None:
    ct = get_recipe("ct-w4a16")
    target = Target.writing(FORMATS["ct_pack_quantized"], (("group_size", 128),))
    source = (("group_size", 32),)
    with pytest.raises(HetquantError, match=r"cannot keep the source's ct_pack_quantized codes"):
        check_repack(ct, target, source, "ct_pack_quantized")
    check_repack(ct.with_options({"requantize": True}), target, source, "ct_pack_quantized")
    same = Target.writing(FORMATS["ct_pack_quantized"], source)
    check_repack(ct, same, source, "ct_pack_quantized")


def test_quantized_reexports() -> None:
    assert quantized.density is density and quantized.LOW_BITS == LOW_BITS
