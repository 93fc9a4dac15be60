"""``hetquant run`` and ``hetquant eval``: the runtime-facing commands.

Standalone click commands; the ``hetquant`` group in :mod:`hetquant.convert.cli` adds them with
``main.add_command``. Exit codes as everywhere: 0 success, 1 a check failed, 2 bad input (one
``error: …`` line from the group).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hetquant.formats import HetquantError

__all__ = ["eval_", "run"]


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--tokens", required=True, help="Comma-separated token ids, e.g. 5,17,42.")
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
    "--save-logits",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write float32 logits [T, vocab] (.npy).",
)
@click.option(
    "--generate",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Greedily generate K tokens.",
)
def run(
    artifact: Path,
    tokens: str,
    tp: int,
    pp: int,
    ep: int,
    subpools: int,
    device: str,
    save_logits: Path | None,
    generate: int,
) -> None:
    """Load ARTIFACT into the given layout (ranks spawned on this host) and run a token sequence."""
    import numpy as np

    from hetquant.runtime.run import RunSpec, run_artifact

    from .cli_common import must_exist

    must_exist(artifact)
    try:
        ids = tuple(int(t) for t in tokens.split(",") if t.strip())
    except ValueError:
        raise HetquantError(
            f"--tokens {tokens!r}: expected comma-separated integers like 5,17,42"
        ) from None
    spec = RunSpec(
        str(artifact), ids, tp=tp, pp=pp, ep=ep, subpools=subpools, device=device, generate=generate
    )
    logits, generated = run_artifact(spec)
    if save_logits is not None:
        np.save(save_logits, logits)
    top = logits.argmax(-1).tolist()
    click.echo(
        f"ran {len(ids)} tokens on tp={tp} pp={pp} ep={ep} ({device}); logits {list(logits.shape)}; next-token argmax {top}"
    )
    if generate:
        click.echo(f"generated: {','.join(map(str, generated))}")


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
    from hetquant.runtime.run import local_model

    from .cli_common import must_exist
    from .hub import resolve_source
    from .source import SourceCheckpoint

    must_exist(artifact)
    must_exist(text)
    root, revision = resolve_source(reference, None, None)
    src = SourceCheckpoint.open(root, revision)
    tokens = token_blocks([text], *load_tokenizer(src.root), samples, seq_len)
    model = local_model(artifact)
    result = evaluate(per_sequence(model.forward), reference_forward_from_source(src), tokens)
    doc = {k: result[k] for k in ("ppl", "ref_ppl", "kl", "top1")}
    click.echo(
        f"ppl {doc['ppl']:.4f} (reference {doc['ref_ppl']:.4f}), KL {doc['kl']:.6f}, top-1 {doc['top1']:.4f} over {samples}x{seq_len} tokens"
    )
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
    failed = (max_kl is not None and doc["kl"] > max_kl) or (
        min_top1 is not None and doc["top1"] < min_top1
    )
    if failed:
        click.echo("FAIL thresholds not met")
        sys.exit(1)
