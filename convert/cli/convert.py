"""``hetquant convert SOURCE OUTPUT --recipe NAME``: parse, plan (``--dry-run`` prints it),
calibrate when asked, convert, report."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path

import click

from hetquant.formats import HetquantError
from hetquant.formats._gc import frozen

from ..fs.os_errors import errors_as_hetquant

__all__ = ["convert"]

log = logging.getLogger("hetquant")


class Progress:
    """tqdm bar (bytes, ETA) on a terminal; a log line every ``every`` seconds otherwise."""

    def __init__(self, total: int, every: float = 10.0) -> None:
        self.total, self.done, self.every = total, 0, every
        self.start = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert")

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif (now := time.monotonic()) - self.last >= self.every:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate else float("inf")
            log.info(
                "converted %.1f%% (%.2f GB, %.0f MB/s, ETA %.0f s)",
                100 * self.done / self.total,
                self.done / 1e9,
                rate / 1e6,
                eta,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.command()
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--recipe", required=True, help="Recipe name (`hetquant recipes` lists them).")
@click.option(
    "--workers", default=1, show_default=True, type=click.IntRange(1), help="Worker processes."
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest root shard (e.g. 5GB, 500MB).",
)
@click.option(
    "--calib-data",
    type=click.Path(exists=True, path_type=Path),
    help="Calibration text (calibrating recipes).",
)
@click.option(
    "--mtp",
    type=click.Choice(["keep", "drop"]),
    help="Multi-token-prediction layer: quantized like a MoE layer (keep, default) or left out.",
)
@click.option(
    "--group-size",
    type=int,
    help="Group size (awq-w4a16: 128 or 64; ascend-w4a16, ct-w4a16: 32 or 128).",
)
@click.option(
    "--cpu-group-size",
    type=int,
    help="ascend-hybrid: CPU experts group-wise, a BF16 scale per 32, 64 or 128 inputs "
    "(default: per-channel).",
)
@click.option(
    "--fp4-layout",
    type=click.Choice(["ascend", "nvfp4"]),
    help="fp4: Ascend 8x8 tiled layout (default) or canonical ModelOpt NVFP4.",
)
@click.option(
    "--requantize",
    is_flag=True,
    default=None,
    help="Allow re-quantizing a low-bit (e.g. INT4) source into another low-bit format "
    "(loses accuracy twice; refused otherwise).",
)
@click.option(
    "--calib-gptq",
    is_flag=True,
    default=None,
    help="ascend-hybrid --calib-data: GPTQ error feedback for the CPU experts' INT4 codes, after "
    "their AWQ scales and clips (gate and up, then down on their quantized output).",
)
@click.option(
    "--keep-dense-down",
    is_flag=True,
    default=None,
    help="ascend-hybrid, ascend-w8a8, ascend-w4a8, ascend-w4a16: the dense layers' MLP "
    "down_proj in BF16 (FLOAT), not W8A8_DYNAMIC: its per-token int8 activations cost the most "
    "accuracy.",
)
@click.option(
    "--quantize-vision",
    is_flag=True,
    default=None,
    help="Vision-language models, Ascend recipes: the vision linears msModelSlim quantizes "
    "(Qwen3-VL blocks' attn.qkv / attn.proj / mlp.linear_fc1; K2.5 blocks' mlp.fc0 / fc1) in "
    "W8A8_DYNAMIC, as vllm-ascend reads them; default: the vision tower at source precision.",
)
@click.option(
    "--calib-device",
    type=click.Choice(["auto", "cpu", "cuda", "npu"]),
    default="auto",
    show_default=True,
    help="--calib-data: where calibration computes. cpu: float64, the same bytes on every CPU; "
    "cuda / npu: BF16 matmuls, faster, other bytes (the manifest says which); auto: an "
    "accelerator when present.",
)
@click.option(
    "--calib-samples",
    default=128,
    show_default=True,
    type=click.IntRange(1),
    help="Calibration samples.",
)
@click.option(
    "--calib-seq-len",
    default=512,
    show_default=True,
    type=click.IntRange(2),
    help="Tokens per sample.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan (outputs, sizes, memory) and exit.")
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact in OUTPUT.")
@click.option(
    "--download-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Hub sources: download here instead of the Hugging Face cache.",
)
@click.option(
    "--token", envvar="HF_TOKEN", show_default=False, help="Hub token (default: $HF_TOKEN)."
)
@errors_as_hetquant
def convert(
    source: str,
    output: Path,
    recipe: str,
    workers: int,
    max_shard_size: str,
    calib_data: Path | None,
    mtp: str | None,
    group_size: int | None,
    cpu_group_size: int | None,
    fp4_layout: str | None,
    requantize: bool | None,
    calib_gptq: bool | None,
    keep_dense_down: bool | None,
    quantize_vision: bool | None,
    calib_device: str,
    calib_samples: int,
    calib_seq_len: int,
    dry_run: bool,
    overwrite: bool,
    download_dir: Path | None,
    token: str | None,
) -> None:
    """Convert SOURCE (a checkpoint directory or a Hub repo id org/name[@revision]) into OUTPUT."""
    marks = {"called": time.time()}  # the start-up's parts, logged with -v (bench_convert_limit)
    from ..engine.calibration import calibrate_for, calibration_targets
    from ..engine.convert import convert as run_convert
    from ..engine.manifest import format_precision, precision_table
    from ..hub import parse_repo_spec, resolve_source
    from ..planning.plan import parse_size, plan_for
    from ..planning.source import SourceCheckpoint
    from ..recipes import get_recipe
    from ..verify import artifact_files, count_files

    workers = _cap_workers(workers)
    given = {"mtp": mtp, "group_size": group_size, "cpu_group_size": cpu_group_size,
             "fp4_layout": fp4_layout, "requantize": requantize or None,
             "calib_gptq": calib_gptq or None, "keep_dense_down": keep_dense_down or None,
             "quantize_vision": quantize_vision or None}  # fmt: skip
    options = {k: v for k, v in given.items() if v is not None}
    rec = get_recipe(recipe).with_options(options) if options else get_recipe(recipe)
    root, revision = resolve_source(source, download_dir, token)
    repo_id = parse_repo_spec(source)[0] if revision is not None else None
    src = SourceCheckpoint.open(root, revision, repo_id)
    marks["opened"] = time.time()
    size = parse_size(max_shard_size)
    if calib_data is not None and not rec.calibrates:
        raise HetquantError(f"recipe {rec.name} does not calibrate; drop --calib-data")
    if calib_gptq and calib_data is None:
        raise HetquantError("--calib-gptq refines a calibration: give --calib-data TEXT too")
    if calib_device != "auto" and calib_data is None:
        raise HetquantError("--calib-device says where to calibrate: give --calib-data TEXT too")
    plan = plan_for(src, rec, size)  # headers only; refuses what the recipe cannot write
    # the source and plan live as long as the command: out of the collector's passes (formats/_gc.py)
    click.get_current_context().with_resource(frozen())
    marks["planned"] = time.time()
    log.debug("start-up %s", json.dumps(marks))
    if calib_data is not None:
        calibration_targets(plan)  # refuses what cannot be calibrated, before any work
    if dry_run:  # the plan from the headers alone: nothing calibrated, nothing written
        _print_plan(plan, src, workers)
        if calib_data is not None:
            click.echo(f"calibration: AWQ on {calib_samples} x {calib_seq_len} tokens of {calib_data}, before the jobs")  # fmt: skip
        click.echo(format_precision(precision_table(plan)))
        return
    calibrate = (  # run by the engine once it holds OUTPUT
        partial(
            calibrate_for,
            src,
            plan,
            calib_data,
            calib_samples,
            calib_seq_len,
            device=None if calib_device == "auto" else calib_device,
        )
        if calib_data is not None
        else None
    )
    progress = Progress(src.total_bytes)
    try:
        result = run_convert(
            src,
            output,
            rec,
            max_shard_size=size,
            workers=workers,
            overwrite=overwrite,
            progress=progress,
            calibrate=calibrate,
            plan=plan,
        )
    finally:
        progress.close()
    n = count_files(artifact_files(output, result.manifest))
    if result.already_complete:
        click.echo(f"{output}: already complete ({n}; same source, recipe and options)")
    else:
        click.echo(f"wrote {output} ({n})")
    click.echo(format_precision(result.manifest["precision"]))


def _cap_workers(workers: int) -> int:
    """``--workers`` at most the CPU cores this process may run on (more only add memory: each
    worker holds its own job buffers), with a warning line when capped."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and workers > cores:
        click.echo(
            f"warning: --workers {workers} capped to {cores}, the CPU cores available here",
            err=True,
        )
        return cores
    return workers


def _print_plan(plan, src, workers: int) -> None:
    from ..engine.jobs import job_peak_bytes

    click.echo(
        f"plan: {len(plan.jobs)} jobs from {len(src.shard_files)} source shards ({src.total_bytes:,} bytes)"
    )
    for f in plan.files:
        click.echo(f"  {f.name:<48} {f.size:>16,} bytes  {len(f.tensors):>6} tensors")
    total = sum(f.size for f in plan.files)
    peak = max((job_peak_bytes(j, src) for j in plan.jobs), default=0)
    click.echo(
        f"total output: {total:,} bytes; peak anonymous memory ≈ {workers} × {peak / 2**20:,.0f} MiB of job buffers + interpreter"
    )
