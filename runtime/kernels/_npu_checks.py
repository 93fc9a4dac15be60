"""What every emulated torch_npu op shares: the documented limits and the ``TORCH_CHECK`` stand-ins.

An input the documentation rules out raises ``RuntimeError`` (:func:`check`), as the real op's
``TORCH_CHECK`` does; NaN / Inf, for which the documentation defines no result, raises
``NotImplementedError`` (:func:`check_finite`).
"""

from __future__ import annotations

import torch

__all__ = ["HALF", "INT8_MAX", "MAX_DIM", "check", "check_finite", "dtype_of"]

MAX_DIM = 65535
INT8_MAX = 127
HALF = (torch.float16, torch.bfloat16)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t.float()).all()):
        raise NotImplementedError(f"{name} contains NaN/Inf: the documentation defines no result")


def dtype_of(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype
