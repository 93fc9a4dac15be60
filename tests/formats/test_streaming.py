"""Row-chunked quantization (``WeightFormat.streaming``) gives the same bytes as quantizing whole."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import FORMATS, get_format
from hetquant.formats.dtypes import torch_dtype

# Shapes with a partial last 128-row block where the format allows one (the tiled layout needs
# N % 256 == 0).
SHAPES = {"nvfp4_ascend": (768, 256)}
OPTIONS = {"w8a8": {"act_min": -3.0, "act_max": 5.0}}
CHUNK = 128


def _stream(fmt, w: torch.Tensor, opts: dict, chunk: int = CHUNK) -> dict[str, torch.Tensor]:
    """What the engine (convert/engine/jobs.py ``_linear``) does with a streaming plan."""
    shape = tuple(w.shape)
    plan = fmt.streaming(shape)
    metas = plan.chunk_format.stored(shape)
    bufs = {k: torch.empty(m.shape, dtype=torch_dtype(m.dtype)) for k, m in metas.items()}
    if plan.needs_amax:
        opts = {**opts, "weight_amax": float(w.abs().amax())}
    for r in range(0, shape[0], chunk):
        for key, part in plan.chunk_format.quantize(w[r : r + chunk], **opts).items():
            axis = plan.axes[key]
            if axis is None:
                bufs[key] = part
            else:
                start = r * bufs[key].shape[axis] // shape[0]
                if plan.place is None or not plan.place(key, bufs[key], part, start):
                    bufs[key].narrow(axis, start, part.shape[axis]).copy_(part)
    return plan.finish(bufs) if plan.finish else bufs


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("chunk", [CHUNK, 40])  # 40 rows: tiled places not whole 32-row runs
@pytest.mark.parametrize("name", sorted(n for n in FORMATS if get_format(n).streaming((768, 256))))
def test_streamed_equals_whole(name: str, chunk: int) -> None:
    fmt = get_format(name)
    torch.manual_seed(1)
    shape = SHAPES.get(name, (576, 256))
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 3).to(
        torch.bfloat16
    )  # rows of unequal range
    whole = fmt.quantize(w, **OPTIONS.get(name, {}))
    streamed = _stream(fmt, w, OPTIONS.get(name, {}), chunk)
    assert set(streamed) == set(whole)
    for key in whole:
        assert torch.equal(_bytes(streamed[key]), _bytes(whole[key])), key


def test_fp8_source_format_does_not_claim_streaming() -> None:
    assert get_format("fp8_block").streaming((256, 256)) is None
