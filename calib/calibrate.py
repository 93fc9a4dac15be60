"""Streaming AWQ calibration of a DeepSeek-V3 checkpoint, one decoder layer at a time.

Lifecycle (``calibrate``): embed the calibration tokens [N, T]; then for each decoder layer L:

1. load layer L's tensors only onto the compute device (``cuda`` / ``npu`` when present, else
   cpu), FP8 → BF16 with DeepSeek's formula: on an accelerator the stored FP8 bytes are copied
   and dequantized there, while layer L + 1's bytes are read ahead (``loading.LayerLoader``);
2. run the float layer on the incoming hidden states with a ``Capture``: the input of every
   linear, and the router's choice, so every routed expert is seen with its own routed tokens
   (``forward.py``);
3. search the AWQ scales (``awq.search_scale``) of the mappings (``layer``), all on the float
   weights and float inputs of step 2 (as AutoAWQ: search every group, then apply);
4. fold them (``Transform``), then search the clip of every quantized linear on its transformed
   weight and transformed input (``awq.search_clip``; AutoAWQ skips q_a / q_b / q);
5. run the layer again with the transformed, fake-quantized weights (each linear's target
   format, quantize → dequantize of the final weight: the artifact's exact values) and pass ITS
   output to layer L + 1 (``propagate="quantized"``, llm-compressor's default: later layers
   calibrate on the inputs they will see; AutoAWQ passes the float output,
   ``propagate="float"``); free layer L.

Peak memory is one layer's BF16 tensors + the hidden states and captured inputs + one float32
weight at a time; per-layer peaks (RSS via ``/proc/self/status`` VmHWM, reset per layer, and the
device allocator's peak) are in ``stats``. The multi-token-prediction layers are not calibrated
(the runtime has no MTP forward): a converter quantizes them round-to-nearest.

Steps 2-5 are ``layer._LayerCalibration``, whose module docstring describes each layer's mappings
(the linears that share one scale, where it is folded); the searches it runs are in
``layer_search``, the options and the transforms in ``transforms``, the saved result in
``result``.

``method="rtn"`` runs the same pipeline with identity scales and no clip: the round-to-nearest
baseline the recipe produces without calibration data.

Targets: ``targets`` maps each quantized linear to its format's quantizer (``quantizer.py``; a
converter takes them from the recipe's plan), ``searched`` names those whose scales and clips
are searched (``layer``'s docstring). Without ``targets``: awq-w4a16's, every linear of the
decoder layers in ``AwqW4A16(options.group_size)``, all searched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from hetquant.formats import HetquantError

from .data import tokens_digest
from .forward import available_device, check_tokens, layer_names, source_tensor_fn
from .gptq import GRIDS
from .layer import _Context, _LayerCalibration, _RowsOf
from .layer_search import QuantizedWeights as _QuantizedWeights
from .loading import LayerLoader
from .quantizer import Quantizer, quantizer_for
from .result import RESULT_FORMAT, RESULT_JSON, RESULT_VERSION, CalibrationResult
from .result import StoredTransforms as _StoredTransforms
from .transforms import _DTYPES, AwqOptions, Transform, apply_transform, is_quantized_linear

__all__ = [
    "AwqOptions",
    "CalibrationResult",
    "Transform",
    "calibrate",
    "is_quantized_linear",
]

# Names defined here before the split into ``transforms`` (since: ``result``) and ``layer``
# (since: ``layer_search``), still importable from
# this module (benchmarks/bench_calibration.py wraps ``_LayerCalibration`` methods through it).
_MOVED = (
    RESULT_FORMAT, RESULT_JSON, RESULT_VERSION, _DTYPES, _StoredTransforms,
    apply_transform, _QuantizedWeights, _RowsOf,
)  # fmt: skip


# -- calibration -----------------------------------------------------------------------------


def calibrate(
    source: Any,
    tokens: torch.Tensor,
    options: AwqOptions | None = None,
    *,
    targets: Mapping[str, Quantizer] | None = None,
    searched: Collection[str] | None = None,
    device: str | torch.device | None = None,
    weights_fn: Callable[[str], torch.Tensor] | None = None,
    names: list[str] | None = None,
    log: Callable[[str], None] | None = None,
    load: str | None = None,
) -> CalibrationResult:
    """Calibrate ``source`` on ``tokens`` [N, T] (see module docstring).

    ``targets``: linear weight name → its quantizer (default: awq-w4a16's); names outside the
    decoder layers (MTP) are left to the converter's round-to-nearest. ``searched``: the targets
    whose AWQ scales and clips are searched (default: all).

    ``source``: anything with ``.config`` (a ``formats.families.ModelConfig``) and ``.tensors``
    (names), and — unless ``weights_fn(name) -> tensor`` is given — ``.dequantized(name)`` (BF16
    weights). ``names`` overrides the tensor names. Options left to the family (``clip_skip``)
    are filled in from it. Deterministic: same inputs, same device type → same transforms; on
    the CPU (float64) bit-identical on every CPU (``awq.py``, "Reproducibility"). ``load``: how
    layers reach the device (``loading.LayerLoader``: ``stored`` bytes dequantized there, or
    ``dequantized`` on the CPU and copied); None picks ``stored`` off the CPU for a checkpoint source without ``weights_fn``.
    """
    opts = options or AwqOptions()
    cfg = source.config
    fam = cfg.family
    if opts.clip_skip is None:
        opts = dataclasses.replace(opts, clip_skip=fam.awq.clip_skip)
    names = list(names if names is not None else source.tensors)
    fn = weights_fn or source_tensor_fn(source)
    dev = available_device(device)
    tokens = check_tokens(tokens, cfg.vocab_size)
    roles = fam.expected_tensors(cfg)
    if targets is None:
        awq_q = quantizer_for("awq_w4a16", {"group_size": opts.group_size})
        targets = {n: awq_q for n in names if n in roles and is_quantized_linear(roles[n])}
    reached = {n for n in names if n in roles and roles[n].layer is not None and not roles[n].mtp}
    quantized = tuple(n for n in names if n in targets and n in reached)
    search = set(quantized) if searched is None else set(searched) & set(quantized)
    kept = {n: targets[n] for n in quantized}
    if opts.gptq:
        _check_gptq(kept, search)
    ctx = _Context(cfg, opts, dev, opts.compute_dtype(dev), tokens.shape[1], tokens)
    if load is None and weights_fn is not None:
        load = "dequantized"  # the caller's tensors
    loader = LayerLoader(source, lambda layer: layer_names(names, layer, fam), dev, fn, load)
    start = time.perf_counter()
    transforms: dict[str, Transform] = {}
    layer_stats = []
    with torch.inference_mode(), contextlib.closing(loader):
        h = ctx.runner.embed(fn(fam.tensor("embed")), tokens)  # [N, T, D]
        for layer in range(cfg.num_hidden_layers):
            rss_reset = _reset_peak_rss()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            state = loader.load(layer)  # and layer + 1's bytes read ahead meanwhile
            h, tf, st = _LayerCalibration(ctx, layer, state, kept, search).run(h)
            transforms.update({n: t.to("cpu") for n, t in tf.items()})
            del state
            st["seconds"] = round(time.perf_counter() - t0, 3)
            st["peak_rss_bytes"] = _peak_rss()
            st["peak_rss_is_per_layer"] = rss_reset
            if dev.type == "cuda":
                st["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(dev))
            layer_stats.append(st)
            if log:
                log(f"layer {layer}: {st['seconds']:.1f}s, rel. output error {st['rel_err']:.4g}")
    stats = {
        "method": opts.method,
        "device": str(dev),
        "load": loader.mode,
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "tokens": {
            "samples": tokens.shape[0],
            "seq_len": tokens.shape[1],
            "sha256": tokens_digest(tokens),
        },
        "seconds": round(time.perf_counter() - start, 3),
        "peak_rss_bytes": max((s["peak_rss_bytes"] or 0) for s in layer_stats)
        if layer_stats
        else None,
        "layers": layer_stats,
    }
    return CalibrationResult(opts, transforms, quantized, stats, fn, kept)


def _check_gptq(targets: Mapping[str, Quantizer], searched: Collection[str]) -> None:
    """Refuse GPTQ when no searched linear's format has a ``gptq.GRIDS`` grid (it would do
    nothing); the searched linears without one keep AWQ's round-to-nearest."""
    fmts = {targets[n].fmt.name for n in searched}
    if searched and not fmts & set(GRIDS):
        first = min(searched)
        raise HetquantError(
            f"{first}: gptq=True, but no searched linear's target format ({sorted(fmts)}) has a "
            f"symmetric q·s grid (GPTQ supports {sorted(GRIDS)}); calibrate without GPTQ"
        )


# -- memory ------------------------------------------------------------------------------------


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    """Peak resident set size (VmHWM) in bytes, or None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
