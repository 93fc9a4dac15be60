"""Constants shared by the calibration tests (see conftest.py)."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-deepseek-v3"
OUTLIER_CHANNELS = torch.arange(0, 256, 32)  # 8 of the 256 hidden channels
OUTLIER_GAIN = 20.0
CALIB = (8, 64)  # samples × tokens of the shared calibrations
HELD_OUT = (4, 64)
MIN_EXPERT_TOKENS = 16  # 512 tokens × top-2 / 8 experts = 128 per expert on average


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread inside the block. The tiny model's matrices are far too small
    for two threads to help, and on a loaded CI machine OpenMP's spinning threads slow these
    tests down by 10x or more (measured: 4.6 s vs 67 s for one calibration)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def weight_zoo(seed: int, shape: tuple[int, int]) -> list[torch.Tensor]:
    """A normal weight, one with outliers, one with all-zero and one-signed rows, a tiny one."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    spiky = w.clone()
    spiky[:, 3] *= 40
    odd = w.clone()
    odd[0] = 0
    odd[1] = odd[1].abs() + 0.25
    return [w, spiky, odd, w * 1e-6]
