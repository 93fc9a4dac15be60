"""``hetquant run`` and ``hetquant eval``: the runtime-facing commands.

Standalone click commands; the ``hetquant`` group in :mod:`hetquant.convert.cli` adds them with
``main.add_command``. Exit codes as everywhere: 0 success, 1 a check failed, 2 bad input (one
``error: …`` line from the group).
"""

from __future__ import annotations

import bisect
import io
import sys
from pathlib import Path
from typing import Any

import click

from hetquant.formats import HetquantError
from hetquant.formats.json_io import require_json_size

from .base import must_exist, writable_output, write_output

__all__ = ["available_memory", "eval_", "run"]

# config.json keys a conversion may rewrite (recipes/metadata.py): not compared with a reference
_CONVERT_REWRITES = {"quantization_config", "num_nextn_predict_layers"}


def available_memory() -> int | None:
    """Bytes of memory available now: MemAvailable (/proc/meminfo), or less when a cgroup v2
    limit (a container's memory.max) leaves less; None where neither can be read."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((cgroup / "memory.current").read_text())
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--tokens", help="Comma-separated token ids, e.g. 5,17,42.")
@click.option(
    "--prompt",
    help="Text, encoded with the artifact's tokenizer.json (instead of --tokens); the generated "
    "tokens are printed decoded (--generate defaults to 16).",
)
@click.option(
    "--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel ranks."
)
@click.option("--pp", default=1, show_default=True, type=click.IntRange(1), help="Pipeline stages.")
@click.option(
    "--ep", default=1, show_default=True, type=click.IntRange(1), help="Expert-parallel ranks."
)
@click.option(
    "--subpools",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="CPU expert subpools (hybrid).",
)
@click.option(
    "--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True
)
@click.option(
    "--dist-backend",
    help="Collectives between ranks: gloo, nccl or hccl [default: the device's own: gloo on cpu, "
    "nccl on cuda, hccl on npu; gloo serves every device, through host copies].",
)
@click.option(
    "--save-logits",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write float32 logits [T, vocab] (.npy).",
)
@click.option(
    "--generate",
    type=click.IntRange(0),
    help="Greedily generate K tokens.  [default: 0; 16 with --prompt]",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="Activation dtype.  [default: float32; bfloat16 on npu]",
)
@click.option(
    "--kv-cache",
    type=click.Choice(["fp8_ds_mla"]),
    help="Emulate a serving engine's KV-cache storage (fp8_ds_mla: vLLM's DeepSeek-V4 cache), "
    "to reproduce that engine's tokens.",
)
def run(
    artifact: Path,
    tokens: str | None,
    prompt: str | None,
    tp: int,
    pp: int,
    ep: int,
    subpools: int,
    device: str,
    dist_backend: str | None,
    save_logits: Path | None,
    generate: int | None,
    dtype: str | None,
    kv_cache: str | None,
) -> None:
    """Load ARTIFACT into the given layout (ranks spawned on this host) and run a token sequence.

    Exit 1 if any logit is NaN or Inf (damaged weights: `hetquant verify ARTIFACT` finds them).
    """
    import numpy as np

    from hetquant.runtime.serving.run import RunSpec, run_artifact

    if tokens is None and prompt is None:
        raise click.UsageError("Missing option '--tokens' (or give '--prompt TEXT')")
    if tokens is not None and prompt is not None:
        raise click.UsageError("give --tokens or --prompt, not both")
    must_exist(artifact)
    tokenizer = None if prompt is None else _tokenizer(artifact)
    ids = _token_ids(tokens) if tokenizer is None else tuple(tokenizer.encode(prompt or "").ids)
    generate = generate if generate is not None else (0 if tokenizer is None else 16)
    if save_logits is not None:
        writable_output(save_logits, "--save-logits")
    spec = RunSpec(
        str(artifact), ids, tp=tp, pp=pp, ep=ep, subpools=subpools, device=device,
        generate=generate, dist_backend=dist_backend, dtype=dtype, kv_cache=kv_cache,
    )  # fmt: skip
    logits, generated = run_artifact(spec)
    if save_logits is not None:
        buf = io.BytesIO()
        np.save(buf, logits)
        write_output(save_logits, buf.getvalue())  # the path as given (np.save adds .npy)
    top = logits.argmax(-1).tolist()
    click.echo(
        f"ran {len(ids)} tokens on tp={tp} pp={pp} ep={ep} ({device}); logits {list(logits.shape)}; next-token argmax {top}"
    )
    if generate:
        click.echo(f"generated: {','.join(map(str, generated))}")
    if tokenizer is not None:
        click.echo(f"text: {tokenizer.decode(generated, skip_special_tokens=True)}")
    bad = int(np.count_nonzero(~np.isfinite(logits)))
    if bad:
        click.echo(
            f"FAIL {bad} of {logits.size} logits are NaN or Inf: the artifact's weights may be "
            f"damaged; run `hetquant verify {artifact}`"
        )
        sys.exit(1)


def _token_ids(tokens: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in (tokens or "").split(",") if t.strip())
    except ValueError:
        raise HetquantError(
            f"--tokens {tokens!r}: expected comma-separated integers like 5,17,42"
        ) from None


def _tokenizer(artifact: Path) -> Any:
    """The artifact's ``tokenizer.json`` (a regular file in it), as a ``tokenizers.Tokenizer``:
    ids as ``transformers`` gives them for the model (its post-processor adds the BOS)."""
    from tokenizers import Tokenizer

    path = artifact / "tokenizer.json"
    if path.is_symlink() or not path.is_file():
        raise HetquantError(
            f"{artifact}: no tokenizer.json (a regular file) for --prompt; give --tokens instead"
        )
    require_json_size(path, path.stat().st_size)  # the library would read it whole
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        raise HetquantError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None


@click.command(name="eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--reference",
    "reference",
    required=True,
    help="The FP8 source checkpoint (directory or org/name[@rev]).",
)
@click.option(
    "--text", required=True, type=click.Path(path_type=Path), help="Held-out text to score."
)
@click.option("--samples", default=8, show_default=True, type=click.IntRange(1), help="Sequences.")
@click.option(
    "--seq-len", default=512, show_default=True, type=click.IntRange(2), help="Tokens per sequence."
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write {ppl, ref_ppl, kl, top1}.",
)
@click.option("--max-kl", type=float, help="Exit 1 if the mean KL exceeds this.")
@click.option("--min-top1", type=float, help="Exit 1 if top-1 agreement is below this.")
def eval_(
    artifact: Path,
    reference: str,
    text: Path,
    samples: int,
    seq_len: int,
    json_out: Path | None,
    max_kl: float | None,
    min_top1: float | None,
) -> None:
    """Perplexity, KL divergence and top-1 agreement of ARTIFACT against its FP8 reference."""
    import json

    from hetquant.calib.data import load_tokenizer, token_blocks
    from hetquant.calib.eval import evaluate, per_sequence, reference_forward_from_source
    from hetquant.formats.families import load_config
    from hetquant.runtime.serving.run import local_model

    from ..hub import resolve_source
    from ..planning.source import SourceCheckpoint

    must_exist(artifact)
    must_exist(text)
    if json_out is not None:
        writable_output(json_out, "--json")
    _check_eval_size(
        load_config(artifact / "config.json").decoder_raw, samples, seq_len
    )  # validated
    root, revision = resolve_source(reference, None, None)
    src = SourceCheckpoint.open(root, revision)
    _check_reference(artifact, src, reference)
    tokens = token_blocks([text], *load_tokenizer(src.root), samples, seq_len)
    model = local_model(artifact)
    result = evaluate(per_sequence(model.forward), reference_forward_from_source(src), tokens)
    doc = {k: result[k] for k in ("ppl", "ref_ppl", "kl", "top1")}
    click.echo(
        f"ppl {doc['ppl']:.4f} (reference {doc['ref_ppl']:.4f}), KL {doc['kl']:.6f}, top-1 {doc['top1']:.4f} over {samples}x{seq_len} tokens"
    )
    if json_out is not None:
        write_output(json_out, (json.dumps(doc, indent=2) + "\n").encode())
    failed = (max_kl is not None and doc["kl"] > max_kl) or (
        min_top1 is not None and doc["top1"] < min_top1
    )
    if failed:
        click.echo("FAIL thresholds not met")
        sys.exit(1)


def _check_eval_size(config: dict[str, Any], samples: int, seq_len: int) -> None:
    """Refuse a ``--seq-len`` beyond the model's positions, or one whose forwards would not fit
    in the memory available (``eval_peak_bytes``), before any work."""
    from hetquant.calib.eval import eval_peak_bytes

    most = config.get("max_position_embeddings")
    if isinstance(most, int) and seq_len > most:
        raise HetquantError(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings {most} "
            f"(config.json); use --seq-len {most} or less"
        )
    need, avail = eval_peak_bytes(config, samples, seq_len), available_memory()
    if avail is None or need <= avail:
        return
    lengths = range(2, seq_len)  # the peak grows with the length: the longest that fits
    fits = bisect.bisect_right(lengths, avail, key=lambda t: eval_peak_bytes(config, samples, t))
    fix = f"use --seq-len {lengths[fits - 1]} or less" if fits else "use fewer --samples"
    raise HetquantError(
        f"--samples {samples} x --seq-len {seq_len}: the forwards need about {need / 1e9:.1f} GB "
        f"(attention scores [heads, T, T] and logits [N, T, vocab], float32) but "
        f"{avail / 1e9:.1f} GB of memory is available; {fix}"
    )


def _check_reference(artifact: Path, src: Any, reference: str) -> None:
    """Refuse a ``--reference`` that is not the checkpoint ARTIFACT was converted from: the
    manifest's source fingerprint (index + config) or, failing that, config.json must agree."""
    from hetquant.formats.families import load_json

    from ..verify import load_manifest

    if load_manifest(artifact)["source"].get("fingerprint") == src.fingerprint:
        return
    ours = load_json(artifact / "config.json")
    theirs = src.config.raw
    keys = sorted((ours.keys() | theirs.keys()) - _CONVERT_REWRITES)
    differ = [k for k in keys if ours.get(k) != theirs.get(k)]
    if differ:
        shown = ", ".join(f"{k} ({ours.get(k)!r} vs {theirs.get(k)!r})" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise HetquantError(
            f"--reference {reference} is not the checkpoint {artifact} was converted from: "
            f"config.json differs in {shown}{more} (artifact vs reference)"
        )
    click.echo(
        f"warning: --reference {reference} has the config of {artifact}'s source but another "
        "index (fingerprint differs): its weights may differ from those converted",
        err=True,
    )
