"""Format identity: ``identify(stored(shape))`` gives back every registered format, its
parameters and the shape; what fits no format, or two, is refused or left plain."""

from __future__ import annotations

import pytest

from hetquant.formats import FORMATS, HetquantError, TensorMeta, get_format
from hetquant.formats.identify import identify

# format → (parameter variants, shapes [out, in]): awkward shapes on purpose (partial FP8 blocks,
# odd rows); every registered format must be listed (test_every_format_is_covered).
VARIANTS: dict[str, tuple[list[dict], list[tuple[int, int]]]] = {
    "bf16": ([{}], [(300, 256), (1, 7)]),
    "fp8_block": ([{}, {"block": 64}], [(160, 256), (160, 200), (7, 9), (129, 1000)]),
    "w8a8_dynamic": ([{}], [(7, 9), (576, 7168)]),
    "w8a8": ([{}], [(7, 9), (160, 256)]),
    "w4a8_dynamic": ([{}, {"bias_chunks": 16}], [(6, 32), (2048, 7168), (7168, 2048)]),
    "awq_w4a16": ([{}, {"group_size": 64}], [(256, 512), (8, 128 * 3)]),
    "ct_pack_quantized": (
        [{}, {"group_size": 32, "scale_dtype": "F32", "shape_dtype": "I32"}],
        [(5, 256), (7, 128 * 5)],
    ),
    "int4_cpu": ([{}], [(6, 10), (1, 2)]),
    "int4_cpu_group": ([{}, {"group_size": 64}], [(6, 128), (3, 64 * 5)]),
    "nvfp4": ([{}, {"with_input_scale": True}], [(6, 32), (160, 256)]),
    "nvfp4_ascend": ([{}, {"with_input_scale": True}], [(256, 64), (512, 128)]),
    "fp4_e2m1": ([{}, {"code_dtype": "U8"}], [(7, 32), (2048, 4096)]),
    "fp8_block_scale": ([{}, {"scale_dtype": "F32"}], [(160, 256), (7, 9), (129, 1000)]),
}


def test_every_format_is_covered() -> None:
    assert set(VARIANTS) == set(FORMATS)


CASES = [
    (name, params, shape)
    for name, (variants, shapes) in VARIANTS.items()
    for params in variants
    for shape in shapes
]


def _pinned_by_shapes(name: str, params: dict, shape: tuple[int, int]) -> bool:
    """False where shapes alone leave a parameter open: an FP8 weight within one block of a
    non-default edge has a 1 x 1 grid, as it would with 128."""
    return not (name.startswith("fp8_block") and max(shape) <= params.get("block", 128))


@pytest.mark.parametrize(("name", "params", "shape"), CASES)
def test_identify_inverts_stored(name: str, params: dict, shape: tuple[int, int]) -> None:
    fmt = get_format(name, **params)
    want = (fmt, shape, frozenset(fmt.stored(shape)))
    got = identify(fmt.stored(shape), prefer=[fmt])
    assert got is not None and (got.fmt, got.shape, got.keys) == want
    if _pinned_by_shapes(name, params, shape):
        got = identify(fmt.stored(shape))
        assert got is not None and (got.fmt, got.shape, got.keys) == want


def test_extra_keys_stay_plain() -> None:
    metas = {
        **get_format("bf16").stored((16, 8)),
        "e_score_correction_bias": TensorMeta("F32", (16,)),
    }
    got = identify(metas)
    assert got is not None and got.fmt.name == "bf16" and got.keys == {"weight"}


def test_the_format_owning_most_keys_wins() -> None:
    w8a8 = get_format("w8a8").stored((8, 16))  # holds w8a8_dynamic's three keys too
    assert identify(w8a8).fmt.name == "w8a8"
    ct = get_format("ct_pack_quantized").stored((8, 256))  # and int4_cpu's key names
    assert identify(ct).fmt.name == "ct_pack_quantized"


@pytest.mark.parametrize(
    "metas",
    [
        {"weight": TensorMeta("BF16", (16,))},  # a norm
        {"weight": TensorMeta("F32", (16, 8))},  # an F32 copy: plain, not bf16
        {"bias": TensorMeta("F32", (16,))},
    ],
)
def test_plain_tensors_have_no_format(metas: dict) -> None:
    assert identify(metas) is None


@pytest.mark.parametrize(
    ("metas", "why"),
    [
        (  # an FP8 weight whose scale grid fits no block
            {
                "weight": TensorMeta("F8_E4M3", (256, 256)),
                "weight_scale_inv": TensorMeta("F32", (3, 5)),
            },
            "fp8_block",
        ),
        (  # AWQ scales of the wrong dtype
            {
                "qweight": TensorMeta("I32", (256, 1)),
                "qzeros": TensorMeta("I32", (2, 1)),
                "scales": TensorMeta("F32", (2, 8)),
            },
            "awq_w4a16",
        ),
        (  # W8A8 with an F16 scale
            {
                "weight": TensorMeta("I8", (4, 4)),
                "weight_scale": TensorMeta("F16", (4, 1)),
                "weight_offset": TensorMeta("F32", (4, 1)),
            },
            "w8a8_dynamic",
        ),
    ],
)
def test_a_quantized_signature_that_fits_nothing_is_refused(metas: dict, why: str) -> None:
    with pytest.raises(HetquantError, match=f"layer.x: stored tensors .* fit no format .*{why}"):
        identify(metas, name="layer.x")


def test_preferred_variant_settles_what_shapes_leave_open() -> None:
    # 100 x 100 in one block: any edge >= 100 gives the same 1 x 1 grid
    stored = get_format("fp8_block", block=256).stored((100, 100))
    assert identify(stored).fmt.block == 128
    assert identify(stored, prefer=[get_format("fp8_block", block=256)]).fmt.block == 256
