"""The routed-expert sum of one MoE layer of per-channel INT4 experts, in one native call.

``int4_moe`` computes what the CPU expert pool's per-expert loop computes with
:func:`~hetquant.runtime.kernels.int4_gemv.int4_gemv` and torch glue::

    for e in experts (in order):                     # entries offsets[g] .. offsets[g+1]-1
        gu  = int4_gemv(gate_up[e], x[tokens])       # [n, 2I]  rows 2i gate, 2i+1 up
        a   = silu(gu[:, 0::2]) * gu[:, 1::2]        # float32: a / (1 + expf(-a)) * up
        out.index_add_(0, tokens, int4_gemv(down[e], a) * weights[:, None])

bit for bit (``tests/runtime/kernels/test_int4_moe.py``), but in the C++ of ``int4_moe.cpp``
(part of the ``int4_gemv`` translation unit), without Python between the experts, and on the
calling thread's worker pool: every token's activation digits are computed once for all its
experts, and the threads split each expert's weight rows in items of ~192 KB (balanced by
bytes, not by experts, so two threads stream the same expert's rows side by side). On a CPU
with AMX-INT8 the GEMVs run on AMX tiles (``int4_gemv.py``): each weight chunk is unpacked
once and multiplied with all of the expert's tokens and digit planes.

It returns ``None`` (the caller then runs its per-expert loop) when it cannot take the call:
backend ``"torch"``, no native kernel, grouped scales, more than ``MAX_NATIVE_TOKENS`` tokens
on one expert with backend ``"auto"``, or a NaN/Inf in ``x`` or in an expert's activations
(the per-expert loop hands those to the torch path, which propagates them as float math does).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetquant.formats import HetquantError

from .int4_gemv import BACKENDS, MAX_K, MAX_NATIVE_TOKENS, PRECISIONS, int4_gemv
from .int4_gemv_native import _get_native, _isa_cap
from .registry import ExpertKernels, register_expert_kernels

__all__ = ["int4_moe"]

_NONFINITE = -3


def _rows(t: torch.Tensor, name: str, dtype: torch.dtype, ndim: int) -> tuple[int, int]:
    """(expert stride, row stride) of a stacked per-expert tensor whose rows are contiguous."""
    if t.dtype != dtype or t.ndim != ndim or (t.numel() and t.stride(-1) != 1):
        raise HetquantError(
            f"int4_moe: {name} must be {dtype} with {ndim} dims and contiguous rows, got "
            f"{t.dtype} {list(t.shape)} strides {t.stride()}"
        )
    return t.stride(0), (t.stride(1) if ndim == 3 else 0)


def int4_moe(
    layer: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    experts: torch.Tensor,
    offsets: torch.Tensor,
    tokens: torch.Tensor,
    weights: torch.Tensor,
    *,
    backend: str = "auto",
    threads: int = 1,
    precision: str = "high",
) -> torch.Tensor | None:
    """``Σ_j weights[j] · expert_{e(j)}(x[tokens[j]])`` into float32 [T, H], or None (above).

    ``layer``: one subpool's per-channel tensors (``gate_up_packed`` U8 [E, 2I, H/2],
    ``gate_up_scale`` F32 [E, 2I], ``down_packed`` U8 [E, H, I/2], ``down_scale`` F32 [E, H];
    views with strided rows allowed); ``x`` float32 [T, H]; ``experts`` int64 [G] (indices into
    E, entries of expert ``experts[g]`` are ``offsets[g] .. offsets[g+1]-1``); ``tokens``
    int64 and ``weights`` float32, one per entry. Sums run in entry order, as the loop above.
    """
    if backend not in BACKENDS or precision not in PRECISIONS:
        raise HetquantError(f"int4_moe: backend {backend!r} / precision {precision!r} unknown")
    gup, gus = layer["gate_up_packed"], layer["gate_up_scale"]
    dnp, dns = layer["down_packed"], layer["down_scale"]
    if backend == "torch" or gus.ndim != 2:  # grouped scales: [E, 2I, 2I/g]
        return None
    nat = _get_native()
    counts = offsets[1:] - offsets[:-1]
    if nat.lib is None or (
        backend == "auto" and counts.numel() and int(counts.max()) > MAX_NATIVE_TOKENS
    ):
        return None
    e, n1, hb = gup.shape
    h = 2 * hb
    if x.dtype != torch.float32 or x.ndim != 2 or x.shape[1] != h or not x.is_contiguous():
        raise HetquantError(f"int4_moe: x must be contiguous float32 [T, {h}], got {list(x.shape)}")
    if h > MAX_K or dnp.shape != (e, h, n1 // 4) or gus.shape != (e, n1) or dns.shape != (e, h):
        raise HetquantError(
            f"int4_moe: layer shapes gate_up {list(gup.shape)} / {list(gus.shape)}, down "
            f"{list(dnp.shape)} / {list(dns.shape)} disagree (or H > {MAX_K})"
        )
    g = experts.numel()
    idx = [t.to(torch.int64).contiguous() for t in (experts, offsets, tokens)]
    if offsets.numel() != g + 1 or tokens.shape != weights.shape:
        raise HetquantError("int4_moe: need offsets [G+1] and one token and weight per entry")
    w32 = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    ptr = [t.data_ptr() for t in (*idx, w32)]
    rc = nat.lib.hq_int4_moe(
        gup.data_ptr(), *_rows(gup, "gate_up_packed", torch.uint8, 3),
        gus.data_ptr(), _rows(gus, "gate_up_scale", torch.float32, 2)[0], n1,
        dnp.data_ptr(), *_rows(dnp, "down_packed", torch.uint8, 3),
        dns.data_ptr(), _rows(dns, "down_scale", torch.float32, 2)[0], h, e,
        x.data_ptr(), x.shape[0], g, *ptr, out.data_ptr(),
        max(1, int(threads)), _isa_cap(nat.best_isa), PRECISIONS[precision],
    )  # fmt: skip
    if rc == _NONFINITE:
        return None
    if rc < 0:
        raise HetquantError(
            f"int4_moe: native kernel failed (code {rc}) for layer {list(gup.shape)}"
        )
    return out


register_expert_kernels("int4", ExpertKernels(gemv=int4_gemv, moe=int4_moe))  # int4_cpu(_group)
