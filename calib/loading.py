"""One decoder layer's tensors on the compute device, the next layer's bytes read ahead.

Two ways to load (``LayerLoader.mode``):

- ``stored`` (default off the CPU, for a source that keeps its stored bytes: a
  ``SourceCheckpoint``, whose tensors name their shard and byte range): the bytes as stored —
  FP8 codes and scales, BF16, F32 — go to the device through the runtime's staged reader
  (``runtime/loading/_reader.py``: pinned buffers, several reader threads, asynchronous copies),
  and each weight is dequantized THERE by its own format (``WeightFormat.source_dequantized``:
  the same validation, the same arithmetic as on the CPU, so the same BF16 bits —
  ``tests/calib/test_loading.py`` compares them). Half the bytes of BF16 cross the bus, and no
  CPU core dequantizes (on the H200 host that was 30% of a MoE layer's time,
  ``benchmarks/README.md``). The layer goes in groups of about ``GROUP_BYTES`` stored bytes, so
  the device holds at most one group's stored bytes (and one chunk's float32 temporaries)
  beside the layer's BF16 tensors: the peak stays that of the layer's BF16 tensors.
- ``dequantized`` (the CPU, and sources that are only ``name → tensor``): ``tensor_fn(name)``
  (the format's CPU path, the fused kernels for FP8), then ``.to(device)``.

Either way, while layer L is calibrated a background thread asks the kernel to read layer
L + 1's byte ranges into the page cache (``POSIX_FADV_WILLNEED``): a source too large for the
page cache is read from disk during the search rather than at the next load.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from hetquant.formats.dtypes import torch_dtype
from hetquant.formats.errors import HetquantError
from hetquant.formats.safe_paths import open_regular
from hetquant.runtime.loading._reader import LoadStats, Span, read_spans

__all__ = ["GROUP_BYTES", "MODES", "LayerLoader"]

GROUP_BYTES = 512 << 20  # stored bytes on the device at once while a layer loads
MODES = ("stored", "dequantized")
TensorFn = Callable[[str], torch.Tensor]


def _stored_parts(source: Any, name: str) -> dict[str, tuple[str, Any]] | None:
    """``{key: (shard, header entry)}`` of ``name`` if ``source`` keeps stored bytes, else None."""
    tensors = getattr(source, "tensors", None)
    t = tensors.get(name) if isinstance(tensors, dict) else None
    parts = getattr(t, "parts", None)
    return parts if parts and getattr(source, "root", None) is not None else None


class LayerLoader:
    """Loads layers of ``source`` onto ``device`` (see the module docstring).

    ``names_of(layer)`` lists a layer's tensor names; ``tensor_fn`` reads one tensor (BF16 for a
    quantized source weight) for the ``dequantized`` mode; ``mode`` None picks ``stored`` off the
    CPU when every tensor of the source has stored bytes, else ``dequantized``.
    """

    def __init__(
        self, source: Any, names_of: Callable[[int], list[str]], device: torch.device,
        tensor_fn: TensorFn, mode: str | None = None,
    ) -> None:  # fmt: skip
        self.source, self.names_of, self.device = source, names_of, device
        self.tensor_fn = tensor_fn
        if mode is None:
            stored = device.type != "cpu" and all(
                _stored_parts(source, n) is not None for n in getattr(source, "tensors", ())
            )
            mode = "stored" if stored and getattr(source, "tensors", None) else "dequantized"
        if mode not in MODES:
            raise ValueError(f"load mode {mode!r}: one of {MODES}")
        self.mode = mode
        self.stats = LoadStats()
        self._ahead: tuple[int, threading.Thread] | None = None

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors on the device; starts reading layer + 1 ahead."""
        if self._ahead is not None:
            self._ahead[1].join()  # a read-ahead of this (or another) layer: done with it
            self._ahead = None
        names = self.names_of(layer)
        if self.mode == "stored":
            state = self._stored(names)
        else:
            state = {n: self.tensor_fn(n).to(self.device) for n in names}
        self.read_ahead(layer + 1)
        return state

    def read_ahead(self, layer: int) -> None:
        """Ask for ``layer``'s source bytes in the page cache, in a background thread."""
        ranges = [
            (file, e.start, e.nbytes)
            for n in self.names_of(layer)
            for file, e in (_stored_parts(self.source, n) or {}).values()
        ]
        if not ranges or not hasattr(os, "posix_fadvise"):
            return
        t = threading.Thread(target=_will_need, args=(Path(self.source.root), ranges), daemon=True)
        t.name = "hetquant-read-ahead"
        t.start()
        self._ahead = (layer, t)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[1].join()
            self._ahead = None

    def _stored(self, names: list[str]) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for group in _groups(names, lambda n: _nbytes(self.source, n)):
            items = [
                (f"{n}\0{key}", file, Span(e.start, e.nbytes, e.nbytes))
                for n in group
                for key, (file, e) in self.source.tensors[n].parts.items()
            ]
            with torch.inference_mode(False):  # the reader's threads copy into these buffers
                raw = read_spans(Path(self.source.root), items, self.device, self.stats)
            for n in group:
                state[n] = self._tensor(n, raw)
            del raw  # the group's stored bytes: freed before the next group is read
        return state

    def _tensor(self, name: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        """Source tensor ``name`` from its stored bytes on the device: plain as stored, a
        format's weight dequantized there."""
        t = self.source.tensors[name]
        stored = {
            key: raw.pop(f"{name}\0{key}").view(torch_dtype(e.dtype)).reshape(e.shape)
            for key, (_, e) in t.parts.items()
        }
        if t.fmt is None:
            return stored["weight"] if "weight" in stored else next(iter(stored.values()))
        return t.fmt.source_dequantized(t.prefix, stored, t.shape)


def _nbytes(source: Any, name: str) -> int:
    return sum(e.nbytes for _, e in source.tensors[name].parts.values())


def _groups(names: list[str], size: Callable[[str], int]) -> Iterable[list[str]]:
    """``names`` in runs of about ``GROUP_BYTES`` (a larger tensor alone)."""
    group: list[str] = []
    total = 0
    for n in names:
        if group and total + size(n) > GROUP_BYTES:
            yield group
            group, total = [], 0
        group.append(n)
        total += size(n)
    if group:
        yield group


def _will_need(root: Path, ranges: list[tuple[str, int, int]]) -> None:
    """``POSIX_FADV_WILLNEED`` on each ``(file, start, length)``: the kernel reads them ahead."""
    fds: dict[str, int] = {}
    try:
        for file, start, length in ranges:
            if file not in fds:
                fds[file] = open_regular(root / file)  # a FIFO would block this thread
            os.posix_fadvise(fds[file], start, length, os.POSIX_FADV_WILLNEED)
    except (OSError, HetquantError):
        pass  # advice only: the load reads the bytes anyway
    finally:
        for fd in fds.values():
            os.close(fd)
