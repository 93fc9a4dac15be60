"""The ``hetquant`` command line. Each command parses, calls the library and reports.

Exit codes: 0 success; 1 a check failed; 2 bad input or usage — one ``error: …`` line, no
traceback (``-v`` shows it).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ..export.exporters import EXPORTERS
from ..fs.os_errors import errors_as_hetquant
from .base import HetquantGroup, must_exist
from .convert import convert
from .run import eval_, run

__all__ = ["main"]

log = logging.getLogger("hetquant")


@click.group(cls=HetquantGroup, name="hetquant")
@click.version_option(package_name="hetquant", prog_name="hetquant", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging and tracebacks.")
def main(verbose: bool) -> None:
    """Convert DeepSeek-V3-family FP8 checkpoints for Ascend NPUs and CPU expert pools."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@main.command()
def recipes() -> None:
    """List the recipes, one line each."""
    from ..recipes import RECIPES

    for name in sorted(RECIPES):
        click.echo(f"{name:<16} {RECIPES[name].summary}")


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
def inspect(path: Path) -> None:
    """Summarise a source checkpoint or an artifact: model, formats by group, sizes, bits/weight."""
    must_exist(path)
    from ..inspect import describe

    click.echo(describe(path))


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
def verify(artifact: Path) -> None:
    """Check every file of ARTIFACT against its manifest; exit 1 if anything is off."""
    must_exist(artifact)
    from ..verify import artifact_files, count_files, load_manifest, user_docs, verify_artifact

    problems = verify_artifact(artifact)
    for p in problems:
        click.echo(f"FAIL {p}")
    if problems:
        click.echo(f"{artifact}: {len(problems)} problem(s)")
        sys.exit(1)
    manifest = load_manifest(artifact)
    click.echo(f"{artifact}: OK ({count_files(artifact_files(artifact, manifest))})")
    if docs := user_docs(artifact, manifest):
        click.echo(f"beside it, not part of it (not checked): {', '.join(docs)}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Choice(sorted(EXPORTERS)),
    help="Target layout: kt-kernel AMXINT4 .kt files (per-channel experts), RAWINT4 "
    "compressed-tensors files (group-wise experts) or MXFP4 files (DeepSeek-V4's FP4 experts).",
)
@click.option(
    "--numa",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="kt-kernel thread pools (--kt-threadpool-count) the files are for.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing export in OUTPUT.")
@errors_as_hetquant
def export(artifact: Path, output: Path, to: str, numa: int, overwrite: bool) -> None:
    """Write ARTIFACT's CPU experts into OUTPUT in another engine's layout (a lossless repack)."""
    must_exist(artifact)
    from ..export import export as run_export
    from ..verify import artifact_files, count_files

    result = run_export(artifact, output, to, numa=numa, overwrite=overwrite)
    n = count_files(artifact_files(output, result.manifest))
    layers = len(result.plan.layers)
    if result.already_complete:
        click.echo(f"{output}: already complete ({n}; same artifact, target and options)")
    else:
        click.echo(f"wrote {output} ({n}): {layers} layer(s) as {to}, {numa} NUMA slice(s)")


def _register_runtime() -> None:
    main.add_command(convert)
    main.add_command(run)
    main.add_command(eval_)


def _register_publish() -> None:
    from .publish import publish

    main.add_command(publish)


_register_runtime()
_register_publish()
