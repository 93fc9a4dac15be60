"""Layers loaded for calibration (calib/loading.py): the stored bytes dequantized where the layer
goes give the very tensors of the CPU path, the calibration does not change, the next layer is
read ahead, and the mode follows the device and the source."""

from __future__ import annotations

import os

import pytest
import torch

from hetquant.calib import calibrate
from hetquant.calib import loading as L
from hetquant.calib.forward import layer_names, source_tensor_fn


def _loader(source, device: str, mode: str | None) -> L.LayerLoader:
    fam = source.config.family
    names = list(source.tensors)
    return L.LayerLoader(source, lambda layer: layer_names(names, layer, fam), torch.device(device), source_tensor_fn(source), mode)  # fmt: skip


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        x, y = a[n].cpu(), b[n].cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, n
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), n


def test_stored_bytes_give_the_cpu_tensors(tiny_source, monkeypatch) -> None:
    """Every layer, in groups small enough that a layer takes several (``GROUP_BYTES``)."""
    monkeypatch.setattr(L, "GROUP_BYTES", 1 << 20)
    stored, plain = _loader(tiny_source, "cpu", "stored"), _loader(tiny_source, "cpu", "dequantized")  # fmt: skip
    with torch.inference_mode():
        for layer in range(tiny_source.config.num_hidden_layers):
            _same(stored.load(layer), plain.load(layer))
    assert stored.stats.tensors > 0 and plain.stats.tensors == 0
    stored.close()


def test_mode_follows_device_and_source(tiny_source) -> None:
    assert _loader(tiny_source, "cpu", None).mode == "dequantized"
    assert _loader(tiny_source, "meta", None).mode == "stored"  # any accelerator

    class Duck:  # config, tensors and dequantized only: no stored bytes to copy
        config, tensors, dequantized = tiny_source.config, tiny_source.tensors, tiny_source.dequantized  # fmt: skip

    assert _loader(Duck(), "meta", None).mode == "dequantized"
    with pytest.raises(ValueError, match="load mode"):
        _loader(tiny_source, "cpu", "fast")


def test_the_next_layer_is_read_ahead(tiny_source, monkeypatch) -> None:
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, n, advice: seen.append((start, n)))
    loader = _loader(tiny_source, "cpu", "dequantized")
    loader.load(0)
    loader.close()  # waits for the read-ahead
    want = {
        (e.start, e.nbytes)
        for n in layer_names(list(tiny_source.tensors), 1, tiny_source.config.family)
        for _, e in tiny_source.tensors[n].parts.values()
    }
    assert set(seen) == want and len(seen) == len(want)


def test_calibration_is_the_same_whichever_way_layers_load(tiny_source, calib_tokens) -> None:
    tokens = calib_tokens[:2, :32]
    a = calibrate(tiny_source, tokens, device="cpu", load="stored")
    b = calibrate(tiny_source, tokens, device="cpu")
    assert a.stats["load"] == "stored" and b.stats["load"] == "dequantized"
    assert sorted(a.transforms) == sorted(b.transforms)
    for name, t in a.transforms.items():
        for key, v in t.tensors().items():
            assert torch.equal(v, b.transforms[name].tensors()[key]), (name, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stored_bytes_dequantized_on_the_gpu_equal_the_cpu_path(tiny_source) -> None:
    gpu, cpu = _loader(tiny_source, "cuda", None), _loader(tiny_source, "cpu", None)
    assert gpu.mode == "stored"
    with torch.inference_mode():  # as calibrate loads (the reader's threads are outside it)
        for layer in range(tiny_source.config.num_hidden_layers):
            got = gpu.load(layer)
            assert all(t.device.type == "cuda" for t in got.values())
            _same(got, cpu.load(layer))
    gpu.close()
