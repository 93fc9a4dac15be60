"""kt-kernel AMXINT4: the per-row INT4 buffers kt-kernel 0.7.2's ``AMXInt4_MOE`` loads, byte for byte.

kt-kernel stores each expert matrix of one NUMA slice as two headerless files (its in-memory
"BufferB", dumped), under ``_layer_{L}/_numa_{N}/`` (reference/cpu_experts.md §7.1, decoded from
files kt-kernel 0.7.2 wrote; §3.1 for the C++ they come from):

=============================================  =====  ==========  ==============================
file                                           dtype  size        content
=============================================  =====  ==========  ==============================
``INT4_{proj}_{E}_{B}Byte_quant_.kt``          U8     n·k/2       codes, tiled (below)
``INT4_{proj}_{E}_{B}Byte_scale_.kt``          F32    4·n         ``d[r]``, one per row
=============================================  =====  ==========  ==============================

``proj`` is ``gate``, ``up`` (each [I/N, H] of NUMA slice N) or ``down`` ([H, I/N]: the slice's
columns of every row), ``E`` the expert, ``B`` the file's own byte size. kt's reader requires the
exact size. Dequantization of row ``r``, element ``k``::

    W[r, k] = q[r, k] · 16 · d[r]          q ∈ [−8, 7]: a two's-complement nibble

Codes. Per row, each 128-element chunk ``[128c, 128c + 128)`` is 64 bytes; byte ``j`` holds
element ``128c + j`` in its LOW nibble and ``128c + j + 64`` in its HIGH nibble.

Tiling. Rows in blocks of ``N_BLOCK`` = 128 (the last may be shorter), each split along k in
blocks of ``K_BLOCK`` = 3584 (the last may be shorter); inside one (row block, k block): groups of
``N_STEP`` = 32 rows, each split in ``B_K_STEP`` = 128-element chunks, loops in that order (row
block, k block, row group, chunk), every tile of 32 rows × 64 bytes = 2048 bytes stored back to
back without padding. A tile's byte ``(i, j)`` (row ``i`` of the group, byte ``j`` of its 64-byte
chunk) is at ``half·1024 + w·64 + r·4 + b`` with ``half, r = divmod(i, 16)`` and
``w, b = divmod(j, 4)``: each 16-row half is a 16 × 16 matrix of 32-bit words, stored transposed
(the AMX / VNNI "B" layout). So the tile of row group ``g`` and chunk ``c`` of block
``(n0, k0)`` (sizes ``nb``, ``kb``) starts at byte ``(n0·k + k0·nb + 32g·kb + 128c·32) / 2``.
Layout constraints: rows % 32 == 0 and k % 128 == 0.

From ``int4_cpu`` (``formats/int4_cpu.py``: codes ``c = q + 8`` in 1..15, pairs (2j, 2j+1) per
byte, F32 ``s`` per row) the conversion is a pure repack: nibble ``c ^ 8`` (= ``q`` in two's
complement), the pairing and tiling above, and ``d = s / 16`` — exact in float32 unless ``s``
is below 2^-122 (then :func:`scale_file` refuses). No code or scale is recomputed. kt's own
converter quantizes each down slice with its own amax; a slice of ours keeps the whole row's
scale (kt memcpy's scales as given: lossless, not byte-equal to kt's converter).
"""

from __future__ import annotations

from ._lazy import torch
from .bits import unpack_nibbles_u8
from .errors import HetquantError

__all__ = [
    "B_K_STEP",
    "K_BLOCK",
    "N_BLOCK",
    "N_STEP",
    "check_shape",
    "file_name",
    "quant_file",
    "scale_file",
]

N_BLOCK = 128  # rows per block
K_BLOCK = 3584  # k per block
N_STEP = 32  # rows per tile
B_K_STEP = 128  # k per tile (64 bytes per row)
_HALF = 16  # rows of one transposed 16 × 16-word matrix
_WORD = 4  # bytes of a word


def file_name(proj: str, expert: int, nbytes: int, kind: str) -> str:
    """kt's name of one file: ``INT4_{proj}_{E}_{B}Byte_{kind}_.kt`` (kind: quant or scale)."""
    return f"INT4_{proj}_{expert}_{nbytes}Byte_{kind}_.kt"


def check_shape(what: str, rows: int, k: int) -> None:
    """Raise unless a [rows, k] matrix meets kt's AMXINT4 layout constraints."""
    if rows <= 0 or rows % N_STEP or k <= 0 or k % B_K_STEP:
        raise HetquantError(
            f"{what}: [{rows}, {k}] does not fit kt-kernel's AMXINT4 layout, which needs rows "
            f"a multiple of {N_STEP} and k a multiple of {B_K_STEP} "
            "(reference/cpu_experts.md §7.1); choose another --numa"
        )


def _amx_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, k] (0..15, offset binary) → kt bytes [n, k/2]: nibbles ``c ^ 8``, byte ``j`` of
    each 128-chunk pairing elements ``j`` (low) and ``j + 64`` (high)."""
    n, k = codes.shape
    q = (codes ^ 8).view(n, k // B_K_STEP, 2, B_K_STEP // 2)  # (n, chunks, lo|hi, 64)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)


def _tile(block: torch.Tensor) -> torch.Tensor:
    """One (row block, k block) of kt bytes [nb, kb/2] → its tiles in storage order, flat."""
    nb, half_kb = block.shape
    t = block.reshape(nb // N_STEP, 2, _HALF, half_kb // 64, 64 // _WORD, _WORD)  # (g,h,r,c,w,b)
    return t.permute(0, 3, 1, 4, 2, 5).reshape(-1)  # (g, c, h, w, r, b)


def quant_file(packed: torch.Tensor) -> torch.Tensor:
    """``int4_cpu`` packed rows U8 [n, k/2] (pairs 2j, 2j+1) → the quant file's bytes U8 [n·k/2]."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    check_shape("kt_amxint4.quant_file", n, k)
    amx = _amx_pairs(unpack_nibbles_u8(packed))  # (n, k/2)
    out = torch.empty(n * k // 2, dtype=torch.uint8)
    for n0 in range(0, n, N_BLOCK):
        nb = min(N_BLOCK, n - n0)
        for k0 in range(0, k, K_BLOCK):
            kb = min(K_BLOCK, k - k0)
            start = (n0 * k + k0 * nb) // 2
            block = amx[n0 : n0 + nb, k0 // 2 : (k0 + kb) // 2]
            out[start : start + nb * kb // 2] = _tile(block)
    return out


def scale_file(what: str, scale: torch.Tensor) -> torch.Tensor:
    """``int4_cpu`` row scales F32 [n] → kt's ``d = s / 16`` F32 [n], refused unless exact."""
    s = scale.to(torch.float32)
    d = s / 16
    if not torch.equal(d * 16, s) or not bool(torch.isfinite(s).all()):
        bad = int((d * 16 != s).sum()) + int((~torch.isfinite(s)).sum())
        raise HetquantError(
            f"{what}: {bad} row scale(s) are not finite or so small that s/16 is inexact in "
            "float32; kt-kernel's AMXINT4 cannot hold them losslessly"
        )
    return d
