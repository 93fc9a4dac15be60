"""formats/nvfp4_ascend_tiles.py: the tile order (against the index formula and the reference
document's positions), exact round trips, refused shapes, tensor-parallel slices of the tiled
tensors, and streamed placement by index arithmetic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import HetquantError
from hetquant.formats.bits import pack_nibbles_u8, unpack_nibbles_u8
from hetquant.formats.nvfp4 import BLOCK
from hetquant.formats.nvfp4_ascend_tiles import (
    K_ALIGN,
    N_ALIGN,
    check_tileable,
    tile_torch,
    tiled_index,
    tiled_slice,
    to_canonical,
    to_tiled,
    transpose_packed,
)

seeds = st.integers(0, 2**31 - 1)


def random_canonical(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical tensors: any weight byte, any non-NaN E4M3 scale byte."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 0x7F, (n, k // BLOCK), generator=g, dtype=torch.uint8)
    scale |= torch.randint(0, 2, scale.shape, generator=g, dtype=torch.uint8) << 7  # sign
    return {
        "weight": weight,
        "weight_scale": scale.view(torch.float8_e4m3fn),
        "weight_scale_2": torch.rand((), generator=g) + 0.5,
    }


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Byte equality of two tensor dicts (names, dtypes, shapes, bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


# ---- tile order ---------------------------------------------------------------------------------
def _tiled_position(k: torch.Tensor, nb: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Byte offset of row-major packed element (k, nb) in order K3 K1 K2 N2 N3 N1 K0 N0."""
    k3, k2, k1, k0 = k // 64, k // 16 % 4, k // 8 % 2, k % 8
    n3, n2, n1, n0 = nb // 128, nb // 16 % 8, nb // 4 % 4, nb % 4
    pos = (k3 * 2 + k1) * 4 + k2
    pos = (pos * 8 + n2) * n_groups + n3
    return ((pos * 4 + n1) * 8 + k0) * 4 + n0


def test_tile_order_matches_index_formula() -> None:
    n, k = 768, 128
    c = random_canonical(n, k, 0)
    kn = pack_nibbles_u8(unpack_nibbles_u8(c["weight"]).T)  # (K, N/2) packed along N
    kk, bb = torch.meshgrid(torch.arange(k), torch.arange(n // 2), indexing="ij")
    want = torch.empty(k * n // 2, dtype=torch.uint8)
    want[_tiled_position(kk, bb, n // 256).reshape(-1)] = kn.reshape(-1)
    assert torch.equal(to_tiled(c)["weight"].reshape(-1), want)


def test_tile_positions_from_reference_doc() -> None:
    """fp4.md §1.5 on a 512 x K toy: bytes 0..31 = k 0..7 x n 0..7; 32 -> n 8; 128 -> n 256;
    256 -> n 32; and even n sits in the low nibble."""
    n, k = 512, 64
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[:, 0] = torch.arange(n) % 16  # column k=0 carries n mod 16 ...
    codes[256, 0], codes[32, 0], codes[8, 0] = 1, 2, 3  # ... except three marker rows
    codes[1, 1] = 5  # (k=1, n=1): high nibble of byte 4
    t = to_tiled({"weight": pack_nibbles_u8(codes), "weight_scale": torch.ones(n, k // 16)})
    w = t["weight"].reshape(-1)
    assert w[0].item() == 0x10  # k=0, n=0 (low) and n=1 (high)
    assert w[1].item() == 0x32 and w[3].item() == 0x76  # n=2,3 and n=6,7
    assert w[4].item() == 0x50  # k=1, n=1 in the high nibble
    assert w[32].item() & 0xF == 3  # n=8
    assert w[128].item() & 0xF == 1  # n=256: next N3 group
    assert w[256].item() & 0xF == 2  # n=32: next N2


# ---- exact round trips ---------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(n3=st.sampled_from([1, 2, 3, 5]), k3=st.sampled_from([1, 2, 3, 7]), seed=seeds)
def test_tiled_canonical_round_trips(n3: int, k3: int, seed: int) -> None:
    c = random_canonical(n3 * N_ALIGN, k3 * K_ALIGN, seed)
    c["input_scale"] = torch.tensor(0.25)
    t = to_tiled(c)
    assert t["weight"].shape == (k3 * K_ALIGN, n3 * N_ALIGN // 2)
    assert t["weight_scale"].shape == (k3 * K_ALIGN // BLOCK, n3 * N_ALIGN)
    assert same_bytes(to_canonical(t), c)
    assert same_bytes(to_tiled(to_canonical(t)), t)


def test_wrong_scale_shape_refused() -> None:
    c = random_canonical(256, 64, 0)
    c["weight_scale"] = c["weight_scale"][:, :2]
    with pytest.raises(HetquantError, match="weight_scale"):
        to_tiled(c)


@pytest.mark.parametrize("shape", [(256, 32), (256, 80), (128, 64), (384, 64), (250, 64)])
def test_untileable_shapes_refused(shape: tuple[int, int]) -> None:
    n, k = shape
    with pytest.raises(HetquantError, match="K % 64 == 0 and N % 256 == 0"):
        check_tileable(n, k)
    c = {"weight": torch.zeros(n, k // 2, dtype=torch.uint8), "weight_scale": torch.ones(n, 1)}
    with pytest.raises(HetquantError, match="cannot be tiled"):
        to_tiled(c)


@pytest.mark.parametrize("cols", [16, 128, 384])
def test_tiled_index_places_column_blocks_where_the_tiling_puts_them(cols: int) -> None:
    kn = transpose_packed(random_canonical(3 * N_ALIGN, 2 * K_ALIGN, 4)["weight"])  # (K, N/2)
    k, nb = kn.shape
    out = torch.zeros(kn.shape, dtype=torch.uint8)  # row-major, as the assembled tensor
    for c in range(0, nb, cols):
        part = kn[:, c : c + cols]
        out.view(-1)[tiled_index(k, nb, c, part.shape[1]).reshape(-1)] = part.reshape(-1)
    assert torch.equal(out, tile_torch(kn))


# ---- tensor parallel slicing --------------------------------------------------------------------
def _canonical_slice(
    c: dict[str, torch.Tensor], dim: int, rank: int, world: int
) -> dict[str, torch.Tensor]:
    n, k = c["weight"].shape[0], 2 * c["weight"].shape[1]
    out = dict(c)
    if dim == 0:
        rows = slice(rank * n // world, (rank + 1) * n // world)
        out["weight"], out["weight_scale"] = c["weight"][rows], c["weight_scale"][rows]
    else:
        kk = k // world
        out["weight"] = c["weight"][:, rank * kk // 2 : (rank + 1) * kk // 2]
        out["weight_scale"] = c["weight_scale"][:, rank * kk // BLOCK : (rank + 1) * kk // BLOCK]
    return {key: t.contiguous() for key, t in out.items()}


N_TP, K_TP = 3 * N_ALIGN, 6 * K_ALIGN  # 768 x 384
ALLOWED = {0: {1, 3}, 1: {1, 2, 3, 6}}  # N % (256 w) == 0; K % (64 w) == 0


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 8])
def test_tiled_slice_equals_tiling_the_canonical_slice(dim: int, world: int) -> None:
    c = random_canonical(N_TP, K_TP, 7)
    t = to_tiled(c)
    if world not in ALLOWED[dim]:
        with pytest.raises(HetquantError, match="not a multiple of"):
            tiled_slice(t, dim, 0, world)
        return
    parts = [tiled_slice(t, dim, r, world) for r in range(world)]
    for rank, part in enumerate(parts):
        assert same_bytes(part, to_tiled(_canonical_slice(c, dim, rank, world)))
    if dim == 1:  # row-parallel: each rank's weight is a contiguous row range of the stored one
        assert torch.equal(torch.cat([p["weight"] for p in parts]), t["weight"])


def test_tiled_slice_bad_arguments() -> None:
    t = to_tiled(random_canonical(N_ALIGN, K_ALIGN, 0))
    with pytest.raises(HetquantError, match="dim must be"):
        tiled_slice(t, 2, 0, 1)
    with pytest.raises(HetquantError, match="outside world"):
        tiled_slice(t, 0, 1, 1)
