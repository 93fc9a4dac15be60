"""Subpool worker threads (``runtime/experts/_worker.py``): CPU sets checked against this
process's affinity, threads that pin themselves (and not the caller), private copies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.runtime.experts._worker import _cpu_sets, _private_copy, _touch
from hetquant.runtime.experts.expert_pool import CpuExpertPool


def test_subpool_threads_pin_themselves(tiny_hybrid: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    with CpuExpertPool.open(tiny_hybrid, subpools=2, cpus=[cpus[:1], cpus[-1:]]) as pool:
        got = [sp.submit(os.sched_getaffinity, 0).result() for sp in pool._subpools]
        assert got == [set(cpus[:1]), set(cpus[-1:])]
    assert os.sched_getaffinity(0) == set(cpus)  # the caller is not pinned


def test_cpu_sets_one_per_subpool() -> None:
    assert _cpu_sets(None, 3) == [None, None, None]
    cpus = sorted(os.sched_getaffinity(0))
    assert _cpu_sets([range(cpus[0], cpus[0] + 1), cpus], 2) == [
        frozenset(cpus[:1]),
        frozenset(cpus),
    ]


@pytest.mark.parametrize(
    ("cpus", "subpools", "match"),
    [
        ([[0]], 2, "one non-empty CPU set per subpool"),
        ([[0], []], 2, "one non-empty CPU set per subpool"),
        ([[1 << 20]], 1, "not available to this process"),
    ],
)
def test_cpu_sets_refused(cpus: list, subpools: int, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        _cpu_sets(cpus, subpools)


def test_private_copy_of_a_strided_view_is_contiguous_and_equal() -> None:
    base = torch.arange(64 * 48, dtype=torch.int32).reshape(64, 48)
    view = base[:, 8:24]  # rows strided, as a subpool slice of down_packed
    copy = _private_copy(view)
    assert copy.is_contiguous() and copy.dtype == view.dtype
    assert torch.equal(copy, view)
    assert copy.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    _touch(view)  # reads only
    _touch(torch.empty(0, dtype=torch.uint8))
    assert torch.equal(base[:, 8:24], copy)
    assert _private_copy(torch.empty(0, 5)).shape == (0, 5)
