"""The precision of a forward's reductions and transcendentals.

Norms, softmax, RoPE and the router compute in ``work_dtype(activation dtype)``: float32 for
BF16 / FP16 / float32 activations (as DeepSeek's and transformers' code do), float64 for float64
ones. Calibration runs the reference forward in float64 on the CPU so that its results do not
depend on the CPU: float32 BLAS and vectorised transcendentals differ between x86 code paths
(AVX-512, AVX2, scalar; MKL's per-CPU kernels) by float32 roundings, which flip the AWQ search's
near-ties; in float64 those differences are ~1e-16 relative, far below the search's tie tolerance
(``calib/awq.py``).
"""

from __future__ import annotations

import torch

__all__ = ["work_dtype"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 when ``dtype`` is float64."""
    return torch.promote_types(dtype, torch.float32)
