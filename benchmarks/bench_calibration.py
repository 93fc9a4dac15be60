"""Benchmark of streaming AWQ calibration: seconds and peak memory per decoder layer.

What is measured is ``hetquant.calib.calibrate(source, tokens, AwqOptions(), device=...)`` — the
whole per-layer pipeline (dequantize the layer, float forward with capture, scale and clip
searches, quantized forward) — through its own ``stats``: per-layer ``seconds``, peak RSS
(VmHWM, reset per layer) and, on CUDA, the allocator's peak. On top of that, per layer, this
script records the process CPU time and (``--no-breakdown`` turns it off) a split of the wall time
into phases, timed by wrapping calibrate's internals (synchronizing the device at each boundary):

=====================  ===========================================================================
``load``               ``LayerLoader.load``: the layer onto the device (stored bytes, dequantized there)
``forward_float``      the float layer with ``Capture`` (attention per sequence, router, MLP/experts)
``attention_search``   scale + clip searches of the MLA linears
``mlp_in_search``      the norm → gate/up scale (dense, or shared + EVERY routed expert at once)
``mlp_units``          up → down scale + clips of the dense MLP / shared expert
``expert_units``       up → down scale + clips of every routed expert
``forward_quantized``  the transformed, fake-quantized layer (its output feeds the next layer)
``other``              the rest: host → device copies, capture joins, transforms to the CPU
=====================  ===========================================================================

Two workloads:

* ``--device cpu`` (default): the trained tiny model ``examples/tiny-deepseek-v3-trained`` (4 layers:
  1 dense + 3 MoE of 16 experts, hidden 384) on ``--samples 16 × --seq-len 256`` tokens of
  ``examples/tiny-tools/heldout.txt`` (``calib.data.token_blocks``; AutoAWQ's 128 × 512 is too
  slow on a 2-core CPU). The result is the ``cpu_tiny_trained`` section of the results file.
* ``--device cuda`` (or ``--synthetic``): a synthetic checkpoint at REAL DeepSeek-V3 shapes made by
  ``make_synthetic.py`` (hidden 7168, MLA, dense intermediate 18432, expert intermediate 2048, one
  shared expert, block FP8, real routing keys), 2 layers: layer 0 dense, layer 1 MoE with
  ``--experts`` routed experts (default 64), calibrated on ``--samples 32 × --seq-len 512`` random
  token ids. Then an extrapolation to DeepSeek-V3/R1 671B calibrated on one accelerator (section
  ``gpu_real_shapes``, or ``synthetic_<device>`` for other devices; ``--tiny-shapes`` uses small
  shapes so the path can be checked on a CPU in seconds: ``synthetic_tiny_<device>``).

Extrapolation (see ``extrapolate``). 671B: 61 calibrated layers (3 dense, 58 MoE; the MTP layer is
not calibrated), 256 routed experts, top-8, 128 × 512 = 65,536 tokens: 2,048 routed tokens per
expert on average. A MoE layer costs ``a·N + E·(b₀ + b₁·L)`` — token-side work ∝ tokens ``N``
(attention, router, shared expert, captures), and per routed expert a weight-side part ``b₀``
(candidate fake-quantizations, clip search on ≤ 512 tokens, dequantization) plus a part ∝ its
routed tokens ``L = N·k/E``. Because ``E·L = k·N``, this is ``(a + k·b₁)·N + b₀·E``: scaling the
measured layer by ``max(N_671B/N, E_671B/E)`` is an upper bound and by the min a lower bound, and
the two factors are EQUAL when the benchmark keeps the 671B's tokens per expert (default: 64
experts × 32 × 512 tokens = 2,048 per expert, both factors 4) — then the estimate does not depend
on how the time splits. A dense layer has fixed shapes: its time lies between the measured one
(all weight-side) and the measured one × ``N_671B/N`` (all token-side); the upper end is used.
One known non-linearity is added: ``awq.search_scale`` evaluates a candidate through the Gram
matrix ``XᵀX`` once tokens > K, an fp32 ``2·N_out·K²`` product that does not shrink with tokens;
linears whose K lies in [bench tokens, 65,536) (o_proj, K = 16384, and the dense down_proj,
K = 18432, at the default 16,384 tokens) switch to it at 671B scale, so their cost is added at
the fp32 matmul rate measured on the device. Peak device memory: the layer's BF16 tensors
(exact, ∝ experts) + the rest of the measured peak × ``N_671B/N`` (hidden states, captured
inputs) + the largest such Gram matrix.

Usage::

    python benchmarks/bench_calibration.py --repeats 3            # CPU, trained tiny model
    python benchmarks/bench_calibration.py --device cuda          # real shapes, ~2-4 min on an H200
    python benchmarks/bench_calibration.py --device cpu --tiny-shapes --experts 2   # quick check
    python benchmarks/bench_calibration.py --merge OTHER.json     # copy OTHER's sections in

``--load compare`` (the default off the CPU) calibrates twice, layers first loaded the old way
(``dequantized``: FP8 → BF16 on the CPU, then copied) and then as ``stored`` bytes dequantized on
the device (``calib/loading.py``), and records both under ``load_compare`` with ``load_ratios``
(per layer: wall and load seconds, peak device memory; the 671B hours); the section's main
figures are the ``stored`` run's. ``--load stored`` / ``dequantized`` runs one of them.

``--repeats N`` calibrates N times and keeps, per layer, the repeat with the least wall time (on
a shared machine contention only adds time), listing every repeat's wall and CPU seconds;
``wall_seconds`` covers all repeats. Progress goes to stderr, the section's JSON to stdout; ``--results`` (default
``benchmarks/results/bench_calibration.json``) is updated section by section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import make_synthetic as ms  # noqa: E402
import torch  # noqa: E402
from _measure import machine_info, write_result  # noqa: E402

RESULT = HERE / "results" / "bench_calibration.json"
TRAINED = REPO / "examples" / "tiny-deepseek-v3-trained"
HELDOUT = REPO / "examples" / "tiny-tools" / "heldout.txt"
DEFAULT_WORK = Path(tempfile.gettempdir()) / "hetquant-bench"
MIB = 1 << 20
GIB = 1 << 30

# DeepSeek-V3 / R1 (671B): what a full calibration run processes (calib.data defaults).
TARGET = {
    "model": "DeepSeek-V3/R1 671B",
    "calibrated_layers": 61,
    "dense_layers": 3,
    "moe_layers": 58,
    "experts": 256,
    "top_k": 8,
    "samples": 128,
    "seq_len": 512,
}
PHASES = (
    "load",
    "forward_float",
    "attention_search",
    "mlp_in_search",
    "mlp_units",
    "expert_units",
    "forward_quantized",
    "other",
)


def log(msg: str) -> None:
    print(f"[bench_calibration] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# instrumentation


class Recorder:
    """Per-layer CPU time and phase split of one ``calibrate`` run (see module docstring).

    Phases are timed by wrapping ``LayerLoader.load``, ``LayerRunner.run`` and three
    ``_LayerCalibration`` methods (restored on exit); the device is synchronized at each boundary
    so that asynchronous kernels are charged to the phase that queued them.
    """

    def __init__(self, device: torch.device, breakdown: bool) -> None:
        self.device, self.breakdown = device, breakdown
        self.acc: dict[str, float] = defaultdict(float)
        self.forward_calls = 0
        self.layers: list[dict[str, Any]] = []
        self._cpu0 = time.process_time()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_layer(self, _msg: str) -> None:
        """``calibrate``'s ``log`` callback: called once per layer, after its stats are made."""
        cpu = time.process_time()
        self.layers.append({"cpu_seconds": round(cpu - self._cpu0, 3), "phases": dict(self.acc)})
        self._cpu0 = cpu
        self.acc.clear()
        self.forward_calls = 0
        log(_msg)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if not self.breakdown:
            yield
            return
        import importlib

        # the module, not the function that hetquant.calib re-exports under the same name
        cal = importlib.import_module("hetquant.calib.calibrate")
        fwd = importlib.import_module("hetquant.calib.forward")

        patches: list[tuple[Any, str, Any]] = []

        def wrap(owner: Any, attr: str, label: Callable[[tuple], str]) -> None:
            orig = getattr(owner, attr)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                name = label(args)
                self.sync()
                t0 = time.perf_counter()
                try:
                    return orig(*args, **kwargs)
                finally:
                    self.sync()
                    self.acc[name] += time.perf_counter() - t0

            patches.append((owner, attr, orig))
            setattr(owner, attr, wrapper)

        def forward_label(_args: tuple) -> str:
            self.forward_calls += 1  # per layer: the float forward first, the quantized one last
            return "forward_float" if self.forward_calls == 1 else "forward_quantized"

        def unit_label(args: tuple) -> str:
            return "expert_units" if ".mlp.experts." in args[1] else "mlp_units"

        loading = importlib.import_module("hetquant.calib.loading")
        wrap(loading.LayerLoader, "load", lambda _a: "load")
        wrap(fwd.LayerRunner, "run", forward_label)
        wrap(cal._LayerCalibration, "_attention", lambda _a: "attention_search")
        wrap(cal._LayerCalibration, "_mlps", lambda _a: "mlps_total")
        wrap(cal._LayerCalibration, "_mlp_unit", unit_label)
        try:
            yield
        finally:
            for owner, attr, orig in reversed(patches):
                setattr(owner, attr, orig)


def run_calibration(
    source: Any, tokens: torch.Tensor, device: str, breakdown: bool, load: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``calibrate`` with the recorder; returns (per-layer records, calibrate's top-level stats).
    ``load``: how layers reach the device (``calib.loading``; None: calibrate's choice)."""
    from hetquant.calib import AwqOptions, calibrate

    dev = torch.device(device)
    rec = Recorder(dev, breakdown)
    opts = AwqOptions()
    with rec.installed():
        result = calibrate(source, tokens, opts, device=dev, log=rec.on_layer, load=load)
    stats = result.stats
    cfg = source.config
    layers = []
    for st, extra in zip(stats["layers"], rec.layers, strict=True):
        moe = cfg.is_moe_layer(st["layer"])
        r: dict[str, Any] = {
            "layer": st["layer"],
            "kind": "moe" if moe else "dense",
            "seconds": st["seconds"],
            "cpu_seconds": extra["cpu_seconds"],
            "peak_rss_bytes": st["peak_rss_bytes"],
            "peak_rss_is_per_layer": st["peak_rss_is_per_layer"],
        }
        if "peak_device_bytes" in st:
            r["peak_device_bytes"] = st["peak_device_bytes"]
        r["rel_err"] = round(st["rel_err"], 6)
        if moe:
            counts = st["expert_tokens"]
            r["experts"] = {
                "count": len(counts),
                "routed_tokens_min": min(counts),
                "routed_tokens_mean": round(sum(counts) / len(counts), 1),
                "routed_tokens_max": max(counts),
                "fallback_experts": len(st["fallback_experts"]),
            }
        if breakdown:
            p = extra["phases"]
            mlps = p.pop("mlps_total", 0.0)
            p["mlp_in_search"] = mlps - p.get("mlp_units", 0.0) - p.get("expert_units", 0.0)
            p["other"] = st["seconds"] - sum(p.values())
            r["phases_s"] = {k: round(p.get(k, 0.0), 3) for k in PHASES}
        layers.append(r)
    top = {k: stats[k] for k in ("method", "device", "load", "dtype", "tokens", "seconds")}
    top["options"] = opts.to_dict()
    return layers, top


def run_repeated(
    source: Any, tokens: torch.Tensor, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``run_calibration`` ``args.repeats`` times; per layer, the record of the repeat with the
    least wall time (contention from other jobs only adds time), with every repeat's times."""
    runs = []
    for i in range(args.repeats):
        if args.repeats > 1:
            log(f"repeat {i + 1} of {args.repeats}")
        runs.append(run_calibration(source, tokens, args.device, not args.no_breakdown, args.load))
    layers = []
    for i in range(len(runs[0][0])):
        recs = [run[0][i] for run in runs]
        rec = dict(min(recs, key=lambda r: r["seconds"]))
        if args.repeats > 1:
            rec["repeat_seconds"] = [r["seconds"] for r in recs]
            rec["repeat_cpu_seconds"] = [r["cpu_seconds"] for r in recs]
        layers.append(rec)
    top = dict(runs[0][1])
    top["repeats"] = args.repeats
    top["seconds"] = min(run[1]["seconds"] for run in runs)
    if args.repeats > 1:
        top["repeat_seconds"] = [run[1]["seconds"] for run in runs]
    return layers, top


def _rss_now() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------
# workload 1: the trained tiny model on held-out text


def bench_trained(args: argparse.Namespace) -> dict[str, Any]:
    from hetquant.calib import load_tokenizer, token_blocks
    from hetquant.convert import SourceCheckpoint

    model = Path(args.model_dir).resolve()
    src = SourceCheckpoint.open(model)
    tokenizer, eos = load_tokenizer(model)
    tokens = token_blocks([args.text], tokenizer, eos, args.samples, args.seq_len)
    log(f"{model.name}: {tokens.shape[0]} × {tokens.shape[1]} tokens of {Path(args.text).name}")
    rss0, load0 = _rss_now(), _loadavg()
    t0 = time.perf_counter()
    layers, top = run_repeated(src, tokens, args)
    c = src.config
    return {
        "workload": "trained tiny model, held-out text",
        "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model),
        "text": str(Path(args.text).resolve().relative_to(REPO))
        if Path(args.text).resolve().is_relative_to(REPO)
        else str(args.text),
        "config": _config_summary(c.raw),
        "calibration": top,
        "wall_seconds": round(time.perf_counter() - t0, 3),
        "rss_before_calibrate_bytes": rss0,
        "loadavg_before": load0,
        "loadavg_after": _loadavg(),
        "layers": layers,
    }


def _config_summary(raw: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size",
        "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
        "n_group", "topk_group", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
    )  # fmt: skip
    return {k: raw.get(k) for k in keys}


# ------------------------------------------------------------------------------------------------
# workload 2: a synthetic checkpoint at real DeepSeek-V3 shapes


def tiny_config(experts: int, vocab: int) -> dict[str, Any]:
    """make_synthetic's config at small shapes, for a quick check of the code path: hidden 256,
    2 heads, latent ranks 128, routing in one group (any expert count ≥ 1)."""
    if experts < 1:
        raise SystemExit(f"error: --experts {experts}: need at least 1")
    return {
        **ms.make_config(16, vocab),
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": experts,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": max(1, min(8, experts // 2)),
    }


@contextlib.contextmanager
def _config_override(config: dict[str, Any]) -> Iterator[None]:
    """``make_synthetic.write_checkpoint`` with ``config`` instead of ``make_config``'s (which
    only knows real shapes); its writer, layout and marker are reused as they are."""
    orig = ms.make_config
    ms.make_config = lambda experts=16, vocab=1024: dict(config)
    try:
        yield
    finally:
        ms.make_config = orig


def ensure_synthetic(
    out: Path, config: dict[str, Any], experts: int, vocab: int, seed: int, tiny: bool
) -> dict[str, Any]:
    """The checkpoint in ``out``: reused when its marker and config match, else (re)written."""
    cfg_path = out / "config.json"
    if ms.is_current(out, experts, vocab, seed) and cfg_path.is_file():
        if json.loads(cfg_path.read_text()) == config:
            marker = json.loads((out / ms.MARKER).read_text())
            return {**marker, "generated_now": False}
    if out.exists() and any(out.iterdir()) and not (out / ms.INDEX).exists():
        if not (out / f".{ms.SHARD}.tmp").exists():
            raise SystemExit(f"error: {out} is not empty and holds no checkpoint")
    log(f"generating {out} ({experts} experts, {'tiny' if tiny else 'real'} shapes) ...")
    if tiny:
        with _config_override(config):
            marker = ms.write_checkpoint(out, experts, vocab, seed, quiet=True)
    else:
        marker = ms.write_checkpoint(out, experts, vocab, seed, quiet=True)
    log(f"  {marker['shard_bytes'] / 1e9:.2f} GB in {marker['seconds']} s")
    return {**marker, "generated_now": True}


def bench_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    from hetquant.convert import SourceCheckpoint

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False")
    tiny = args.tiny_shapes
    config = (
        tiny_config(args.experts, args.vocab) if tiny else ms.make_config(args.experts, args.vocab)
    )
    shapes = "tiny" if tiny else "real"
    out = Path(args.source) if args.source else (
        Path(args.work) / f"calib-synthetic-{shapes}-e{args.experts}-v{args.vocab}-s{args.seed}"
    )  # fmt: skip
    t_gen = time.perf_counter()
    marker = ensure_synthetic(out, config, args.experts, args.vocab, args.seed, tiny)
    gen_wall = round(time.perf_counter() - t_gen, 2)
    src = SourceCheckpoint.open(out)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.samples, args.seq_len), generator=g)
    log(
        f"calibrating on {dev}: {args.samples} × {args.seq_len} random token ids, "
        f"{args.experts} experts (top-{config['num_experts_per_tok']})"
    )
    if dev.type == "cuda":
        torch.cuda.init()
        log(f"  {torch.cuda.get_device_name(dev)}")
    rss0, load0 = _rss_now(), _loadavg()
    device_info = _device_info(dev)
    rate = _fp32_matmul_rate(dev, small=tiny or dev.type == "cpu")
    modes = ["dequantized", "stored"] if args.load == "compare" else [args.load]
    compare: dict[str, Any] = {}
    for mode in modes:  # the baseline first; the last mode's run is the section's main result
        log(f"  layers loaded: {mode or 'calibrate default'}")
        t0 = time.perf_counter()
        layers, top = run_repeated(src, tokens, argparse.Namespace(**{**vars(args), "load": mode}))
        wall = round(time.perf_counter() - t0, 3)
        for r in layers:
            log(f"  layer {r['layer']} ({r['kind']}): {r['seconds']} s, load {r.get('phases_s', {}).get('load', '?')} s, peak {_mem_text(r)}")  # fmt: skip
        ex = extrapolate(layers, config, args.samples * args.seq_len, rate, device_info.get("total_memory_bytes"))  # fmt: skip
        compare[top["load"]] = {"calibration": top, "wall_seconds": wall, "layers": layers, "extrapolation_671b": ex}  # fmt: skip
    result = {
        "workload": f"synthetic checkpoint, {shapes} DeepSeek-V3 shapes, random token ids",
        "checkpoint": {
            "path": str(out),
            "generator": "benchmarks/make_synthetic.py",
            "shard_bytes": marker["shard_bytes"],
            "generate_seconds": marker["seconds"],
            "generated_now": marker["generated_now"],
            "prepare_wall_seconds": gen_wall,
        },
        "config": _config_summary(config),
        "device_info": device_info,
        "calibration": top,
        "wall_seconds": wall,
        "rss_before_calibrate_bytes": rss0,
        "loadavg_before": load0,
        "loadavg_after": _loadavg(),
        "layers": layers,
    }
    result["extrapolation_671b"] = ex
    if len(compare) > 1:
        result["load_compare"] = compare
        result["load_ratios"] = _load_ratios(compare["stored"], compare["dequantized"])
        log(f"  stored / dequantized: {result['load_ratios']}")
    if tiny:
        result["extrapolation_671b"]["note"] = (
            "tiny shapes: the numbers only exercise the code path; they say nothing about 671B"
        )
    return result


def _load_ratios(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """Layers loaded as stored bytes (dequantized on the device) against the CPU dequantization:
    per layer, wall seconds, load seconds and peak device memory, new / old; 671B hours."""
    out: dict[str, Any] = {}
    for a, b in zip(new["layers"], old["layers"], strict=True):
        r = {"seconds": round(a["seconds"] / b["seconds"], 3)}
        la, lb = a.get("phases_s", {}).get("load"), b.get("phases_s", {}).get("load")
        if la is not None and lb:
            r["load_seconds"] = [lb, la]
        if a.get("peak_device_bytes") and b.get("peak_device_bytes"):
            r["peak_device_bytes"] = round(a["peak_device_bytes"] / b["peak_device_bytes"], 4)
        out[f"layer_{a['layer']}_{a['kind']}"] = r
    out["hours_671b"] = [old["extrapolation_671b"]["total_hours"], new["extrapolation_671b"]["total_hours"]]  # fmt: skip
    return out


def _mem_text(r: dict[str, Any]) -> str:
    if "peak_device_bytes" in r:
        return f"{r['peak_device_bytes'] / GIB:.2f} GiB device"
    return f"{(r['peak_rss_bytes'] or 0) / MIB:.0f} MiB RSS"


def _device_info(dev: torch.device) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"type": dev.type}
    p = torch.cuda.get_device_properties(dev)
    return {
        "type": "cuda",
        "name": p.name,
        "total_memory_bytes": int(p.total_memory),
        "multiprocessors": p.multi_processor_count,
        "torch_cuda": torch.version.cuda,
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


def _fp32_matmul_rate(dev: torch.device, small: bool) -> dict[str, Any]:
    """FLOP/s of ``err @ gram`` in float32 (the Gram path of ``awq_stats.sq_out``) at o_proj's 671B
    shape [7168, 16384] @ [16384, 16384] (``small``: [256, 512] @ [512, 512])."""
    m, k = (256, 512) if small else (7168, 16384)
    with torch.inference_mode():
        a = torch.randn(m, k, device=dev)
        g = torch.randn(k, k, device=dev)
        times = []
        for i in range(4):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            y = a @ g
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        del a, g, y
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    best = min(times)
    return {"shape": [m, k, k], "seconds": round(best, 5), "flops_per_s": 2 * m * k * k / best}


# ------------------------------------------------------------------------------------------------
# extrapolation to 671B


def _layer_state_bytes(config: dict[str, Any], layer: int) -> int:
    """Bytes of layer ``layer``'s tensors on the device during calibration: FP8 weights as BF16
    (``source_tensor_fn``), everything else as stored; no ``weight_scale_inv``."""
    prefix = f"model.layers.{layer}."
    total = 0
    for s in ms.tensor_specs(config):
        if s.name.startswith(prefix) and s.kind != "scale":
            total += s.nbytes * (2 if s.dtype == "F8_E4M3" else 1)
    return total


def _gram_switches(c: dict[str, Any], n_bench: int, n_real: int) -> dict[str, list[dict]]:
    """Scale searches over ALL tokens whose input width K satisfies n_bench ≤ K < n_real: they
    take the direct path in the benchmark and the Gram path (``tokens > K``) at 671B scale.
    Per-expert searches keep their token count (tokens per expert), so they do not switch."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_in = [("attn_in", h, (c["q_lora_rank"] or heads * (nope + rope)) + c["kv_lora_rank"] + rope)]
    attn = [
        *q_in,
        ("kv_b", c["kv_lora_rank"], heads * (nope + v)),
        ("o", heads * v, h),
    ]
    if c["q_lora_rank"]:
        attn.append(("q_b", c["q_lora_rank"], heads * (nope + rope)))
    shared = c["moe_intermediate_size"] * c["n_shared_experts"]
    dense = [("mlp_in", h, 2 * c["intermediate_size"]), ("down", c["intermediate_size"], h)]
    moe = [("shared mlp_in", h, 2 * shared), ("shared down", shared, h)] if shared else []

    def pick(items: list[tuple[str, int, int]]) -> list[dict]:
        return [{"search": n, "K": k, "N_out": o} for n, k, o in items if n_bench <= k < n_real]

    return {"dense": pick(attn + dense), "moe": pick(attn + moe)}


EXTRAPOLATION_ASSUMPTIONS = [
    "layers of one kind cost the same (same shapes; only the data differ)",
    "MoE layer = a·tokens + experts·(b0 + b1·tokens_per_expert) = (a + k·b1)·tokens + "
    "b0·experts: scaled by max(token factor, expert factor) (min for the low end); "
    "the factors are equal when tokens per expert match the 671B's 2048",
    "dense layer: between measured (weight-side work) and measured × token factor "
    "(token-side work); the upper end is the estimate",
    "plus the fp32 Gram-path products of scale searches whose K lies in "
    "[bench tokens, 671B tokens), at the measured fp32 matmul rate",
    "random routing here is near-uniform; real routing is skewed, which moves time "
    "between experts but not the total routed tokens; experts with < 128 tokens fall "
    "back to all tokens (a few extra expert forwards each)",
    "the 61 layers run one after another on one accelerator; MTP layer not calibrated",
]


def _peak_device(
    layers_of: dict[str, tuple[dict[str, Any], int, int]],
    config: dict[str, Any],
    real_cfg: dict[str, Any],
    f_n: float,
    device_total: int | None,
) -> dict[str, Any]:
    """Peak device memory of a 671B layer of each kind, from the measured (layer record, layer
    number, Gram bytes): the layer's tensors exactly, the rest of the peak × the token factor."""
    mem = {}
    for kind, (r, layer, gram) in layers_of.items():
        s_b = _layer_state_bytes(config, layer)
        s_r = _layer_state_bytes(real_cfg, layer)
        rest = max(0, r["peak_device_bytes"] - s_b)
        mem[kind] = {
            "bench_peak_bytes": r["peak_device_bytes"],
            "bench_layer_tensors_bytes": s_b,
            "layer_tensors_bytes": s_r,
            "activations_bytes": int(rest * f_n),
            "gram_bytes": gram,
            "estimate_bytes": int(s_r + rest * f_n + gram),
        }
    peak = max(m["estimate_bytes"] for m in mem.values())
    return {
        **mem,
        "estimate_bytes": peak,
        "estimate_gib": round(peak / GIB, 1),
        "device_total_bytes": device_total,
        "fits_device": None if device_total is None else peak < device_total,
        "assumption": "layer tensors exact (BF16, ∝ experts); the rest of the measured peak "
        "(hidden states, captured inputs, fp32 weight copies) × token factor; + Gram",
    }


def extrapolate(
    layers: list[dict[str, Any]],
    config: dict[str, Any],
    n_bench: int,
    rate: dict[str, Any],
    device_total: int | None,
) -> dict[str, Any]:
    """Seconds and peak device memory of a 671B calibration from one dense and one MoE layer
    (model in the module docstring)."""
    from hetquant.calib import AwqOptions

    dense = next(r for r in layers if r["kind"] == "dense")
    moe = next(r for r in layers if r["kind"] == "moe")
    e_b, k_b = config["n_routed_experts"], config["num_experts_per_tok"]
    t = TARGET
    n_real = t["samples"] * t["seq_len"]
    f_n, f_e = n_real / n_bench, t["experts"] / e_b
    load_b, load_real = n_bench * k_b / e_b, n_real * t["top_k"] / t["experts"]

    real_cfg = ms.make_config(t["experts"], config["vocab_size"])
    candidates = AwqOptions().grid + 1  # identity + grid ratios
    switches = _gram_switches(real_cfg, n_bench, n_real)

    def gram_s(kind: str) -> float:
        flops = sum(candidates * 2 * s["N_out"] * s["K"] ** 2 for s in switches[kind])
        return flops / rate["flops_per_s"]

    def gram_bytes(kind: str) -> int:
        return max((4 * s["K"] ** 2 for s in switches[kind]), default=0)

    dense_hi, dense_lo = dense["seconds"] * f_n + gram_s("dense"), dense["seconds"]
    moe_hi = moe["seconds"] * max(f_n, f_e) + gram_s("moe")
    moe_lo = moe["seconds"] * min(f_n, f_e)
    total = t["dense_layers"] * dense_hi + t["moe_layers"] * moe_hi
    low = t["dense_layers"] * dense_lo + t["moe_layers"] * moe_lo
    out: dict[str, Any] = {
        "target": {**t, "tokens": n_real, "routed_tokens_per_expert": load_real},
        "bench": {
            "tokens": n_bench,
            "experts": e_b,
            "top_k": k_b,
            "routed_tokens_per_expert": load_b,
        },
        "factors": {"tokens": round(f_n, 4), "experts": round(f_e, 4)},
        "load_matched": abs(load_b - load_real) < 1e-9 and k_b == t["top_k"],
        "gram_path_switches": switches,
        "fp32_matmul": {
            "shape": rate["shape"],
            "seconds": rate["seconds"],
            "tflops": round(rate["flops_per_s"] / 1e12, 3),
        },
        "seconds_per_layer": {
            "dense": round(dense_hi, 2),
            "dense_low": round(dense_lo, 2),
            "moe": round(moe_hi, 2),
            "moe_low": round(moe_lo, 2),
            "gram_added_dense": round(gram_s("dense"), 2),
            "gram_added_moe": round(gram_s("moe"), 2),
        },
        "total_seconds": round(total, 1),
        "total_hours": round(total / 3600, 2),
        "total_hours_low": round(low / 3600, 2),
        "assumptions": EXTRAPOLATION_ASSUMPTIONS,
    }
    if not out["load_matched"]:
        out["note"] = (
            f"routed tokens per expert here ({load_b:g}, top-{k_b}) differ from the 671B's "
            f"({load_real:g}, top-{t['top_k']}): only the range [total_hours_low, total_hours] "
            "is meaningful; for one number use experts = samples × seq_len × 8 / 2048"
        )
    if "peak_device_bytes" in dense and "peak_device_bytes" in moe:
        layers_of = {"dense": (dense, 0, gram_bytes("dense")), "moe": (moe, 1, gram_bytes("moe"))}
        out["peak_device_bytes"] = _peak_device(layers_of, config, real_cfg, f_n, device_total)
    return out


# ------------------------------------------------------------------------------------------------
# results file


def update_results(path: Path, sections: dict[str, Any]) -> Path:
    doc: dict[str, Any] = {"benchmark": "bench_calibration"}
    if path.is_file():
        doc = json.loads(path.read_text())
    doc.update(sections)
    return write_result(path, doc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (default) | cuda | npu")
    ap.add_argument(
        "--synthetic",
        action="store_true",
        help="synthetic real-shape checkpoint also on cpu (implied by any other device)",
    )
    ap.add_argument("--tiny-shapes", action="store_true", help="synthetic, small shapes (check)")
    ap.add_argument("--samples", type=int, help="calibration sequences (16 trained, 32 synthetic)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (256 trained, 512 synthetic)")
    ap.add_argument("--experts", type=int, default=64, help="synthetic routed experts (64)")
    ap.add_argument("--vocab", type=int, default=1024, help="synthetic vocab_size (1024)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=str(DEFAULT_WORK), help="where the synthetic checkpoint goes")
    ap.add_argument("--source", help="synthetic checkpoint directory (default: under --work)")
    ap.add_argument("--model-dir", default=str(TRAINED), help="trained model (cpu workload)")
    ap.add_argument("--text", default=str(HELDOUT), help="calibration text (cpu workload)")
    ap.add_argument("--no-breakdown", action="store_true", help="no phase split (no wrapping)")
    ap.add_argument(
        "--load",
        choices=("compare", "stored", "dequantized"),
        help="how layers reach the device (calib/loading.py): stored bytes dequantized there, "
        "or dequantized on the CPU and copied; compare: both, one after the other (the default "
        "off the CPU); default on the CPU: calibrate's choice",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="calibrations; per layer the fastest is kept (1)"
    )
    ap.add_argument("--results", default=str(RESULT), help="results JSON updated by section")
    ap.add_argument("--no-write", action="store_true", help="print the JSON only")
    ap.add_argument("--merge", metavar="JSON", help="copy the sections of JSON into --results")
    args = ap.parse_args(argv)

    if args.merge:
        other = json.loads(Path(args.merge).read_text())
        sections = {k: v for k, v in other.items() if k != "benchmark"}
        path = update_results(Path(args.results), sections)
        print(f"merged {sorted(sections)} into {path}")
        return

    synthetic = args.synthetic or args.tiny_shapes or torch.device(args.device).type != "cpu"
    if args.load is None and torch.device(args.device).type != "cpu":
        args.load = "compare"
    if synthetic:
        args.samples = args.samples or (4 if args.tiny_shapes else 32)
        args.seq_len = args.seq_len or (64 if args.tiny_shapes else 512)
        result = bench_synthetic(args)
        dev_type = torch.device(args.device).type
        if args.tiny_shapes:
            name = f"synthetic_tiny_{dev_type}"
        else:
            name = "gpu_real_shapes" if dev_type == "cuda" else f"synthetic_{dev_type}"
    else:
        args.samples = args.samples or 16
        args.seq_len = args.seq_len or 256
        result = bench_trained(args)
        name = "cpu_tiny_trained"
    section = {"machine": machine_info(), **result}
    print(json.dumps({name: section}, indent=2))
    if not args.no_write:
        path = update_results(Path(args.results), {name: section})
        log(f"wrote section {name!r} of {path}")
    ex = result.get("extrapolation_671b")
    if ex:
        log(
            f"671B on one {result['device_info'].get('name', args.device)}: ≈ {ex['total_hours']} h "
            f"(low {ex['total_hours_low']} h); dense layer {ex['seconds_per_layer']['dense']} s, "
            f"MoE layer {ex['seconds_per_layer']['moe']} s"
            + (
                f"; peak device memory ≈ {ex['peak_device_bytes']['estimate_gib']} GiB"
                if "peak_device_bytes" in ex
                else ""
            )
        )


if __name__ == "__main__":
    main()
