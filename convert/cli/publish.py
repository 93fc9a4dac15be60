"""``hetquant publish ARTIFACT REPO_ID``: verify, write the model card, check limits, upload.

A standalone click command; the ``hetquant`` group adds it with ``main.add_command(publish)``.
Exit codes as everywhere: 0 published (or nothing to change), 1 the artifact failed
verification or breaks a Hub limit, 2 bad input or a Hub error (one ``error: …`` line).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from hetquant.formats import HetquantError
from hetquant.formats.filenames import INDEX_NAME
from hetquant.formats.json_io import load_json
from hetquant.formats.safe_paths import is_inside, read_regular

__all__ = ["publish"]

log = logging.getLogger("hetquant.publish")


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository private (new repos only).")
@click.option("--revision", default=None, help="Branch to commit to; created from main if missing.")
@click.option("--create-pr", is_flag=True, help="Open a pull request against main instead.")
@click.option("--dry-run", is_flag=True, help="Print the model card and the files; upload nothing.")
@click.option(
    "--license",
    "license_id",
    default=None,
    help="License id for the card (default: the source model card's, e.g. mit).",
)
@click.option(
    "--base-model", default=None, help="Source repo id for the card (default: from the manifest)."
)
@click.option("--commit-message", default=None, help="Commit message (default: recipe + version).")
@click.option(
    "--token",
    envvar="HF_TOKEN",
    default=None,
    show_default=False,
    show_envvar=False,
    help="Hub write token (default: $HF_TOKEN or the saved login). Never printed.",
)
def publish(
    artifact: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    create_pr: bool,
    dry_run: bool,
    license_id: str | None,
    base_model: str | None,
    commit_message: str | None,
    token: str | None,
) -> None:
    """Upload ARTIFACT to the Hub repository REPO_ID (org/name) with a generated model card.

    The artifact is verified first. Re-running resumes an interrupted upload; when nothing
    changed it makes no commit.
    """
    token = token or None
    try:
        _publish(
            artifact, repo_id, private, revision, create_pr, dry_run, license_id, base_model,
            commit_message, token,
        )  # fmt: skip
    except (HetquantError, OSError) as e:
        from ..hub import redact
        from .base import error_line

        if log.isEnabledFor(logging.DEBUG):
            log.debug("publish failed", exc_info=True)
        click.echo(f"error: {redact(error_line(e), token)}", err=True)
        sys.exit(2)


def _publish(
    artifact: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    create_pr: bool,
    dry_run: bool,
    license_id: str | None,
    base_model: str | None,
    commit_message: str | None,
    token: str | None,
) -> None:
    from ..engine.manifest import MANIFEST_NAME
    from ..hub import check_credentials, check_hub_limits, parse_repo_spec, upload_artifact
    from ..hub.model_card import CardInputs, base_model_from, render_card
    from ..verify import (
        artifact_files,
        count_files,
        licence_files,
        load_manifest,
        verify_artifact,
    )

    if parse_repo_spec(repo_id) != (repo_id, None):
        raise HetquantError(f"{repo_id}: REPO_ID must be a Hub repo id, org/name")
    if create_pr and revision not in (None, "main"):
        raise HetquantError("--create-pr opens the pull request against main; drop --revision")
    if base_model is not None and parse_repo_spec(base_model) != (base_model, None):
        raise HetquantError(f"--base-model {base_model}: not a Hub repo id (org/name)")
    if not dry_run:  # before hours of hashing and before anything is sent
        user = check_credentials(token)
        log.info("publishing as %s", user or "(the Hub did not say: rate-limited)")

    problems = verify_artifact(artifact)
    if problems:
        for p in problems:
            click.echo(f"FAIL {p}")
        click.echo(f"{artifact}: {len(problems)} problem(s); not publishing", err=True)
        sys.exit(1)
    manifest = load_manifest(artifact)
    sizes = {f: n for f, n in artifact_files(artifact, manifest).items() if f != "README.md"}
    click.echo(f"verified {artifact}: {count_files(sizes)} OK")
    licences = licence_files(artifact, manifest)  # the user's, beside it: they travel too
    if licences:
        click.echo(f"with {', '.join(licences)} (not part of the artifact: not verified)")
    sizes |= {n: (artifact / n).stat().st_size for n in licences}
    files = [*(f for f in sizes if f != MANIFEST_NAME), MANIFEST_NAME]  # the manifest last

    config = _read_json(artifact / "config.json")
    note = None
    if base_model is None:
        base_model, note = base_model_from(manifest, config)
    license_id = license_id or _source_license(artifact, manifest, base_model)
    if not license_id:
        raise HetquantError(
            "no license found in the source model card or a LICENSE file; pass --license ID "
            "(the base model's, e.g. mit for DeepSeek-V3 / R1)"
        )
    card = render_card(
        CardInputs(
            manifest,
            repo_id,
            license=license_id,
            base_model=base_model,
            base_model_note=note,
            config=config,
            recipe_summary=_recipe_summary(manifest["recipe"]["name"]),
        )
    )

    sizes["README.md"] = len(card.encode())
    index_path = artifact / INDEX_NAME
    report = check_hub_limits(sizes, _read_json(index_path) or None, private=private)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    if report.errors:
        for e in report.errors:
            click.echo(f"FAIL {e}")
        click.echo(
            f"{artifact}: breaks {len(report.errors)} Hub limit(s); not publishing", err=True
        )
        sys.exit(1)

    where = f"{repo_id} ({'private' if private else 'public'}, " + (
        "pull request against main)" if create_pr else f"branch {revision or 'main'})"
    )
    what = f"the artifact's {len(files)} files and README.md"
    if dry_run:
        click.echo(f"dry run: would publish {artifact} to {where}")
        click.echo("--- README.md ---")
        click.echo(card, nl=False)
        click.echo(f"--- {what}: {sum(sizes.values()):,} bytes ---")
        for name in sorted(sizes):
            click.echo(f"  {name:<52} {sizes[name]:>16,}")
        return

    click.echo(f"uploading {what} ({sum(sizes.values()):,} bytes) to {where}")
    msg = commit_message or (
        f"Upload {manifest['recipe']['name']} artifact (hetquant {manifest.get('hetquant_version', '?')})"
    )
    result = upload_artifact(
        artifact,
        repo_id,
        files,
        card,
        private=private,
        revision=revision,
        create_pr=create_pr,
        token=token,
        commit_message=msg,
    )
    if private and result.private is False:
        click.echo(
            f"warning: {repo_id} already existed and is public; --private applies only when the "
            "repository is created (change its visibility in the repository settings)",
            err=True,
        )
    if result.pr_url:
        click.echo(f"opened pull request {result.pr_url}")
    elif result.changed:
        click.echo(f"committed {result.commit_oid} to {repo_id}@{result.revision}")
    else:
        click.echo(
            f"nothing changed: {repo_id}@{result.revision} is already up to date ({result.commit_oid})"
        )
    click.echo(result.repo_url)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = load_json(path)
    except (OSError, HetquantError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _source_license(artifact: Path, manifest: dict[str, Any], base_model: str | None) -> str | None:
    from ..hub.model_card import license_from_text

    card = license_file = None
    src = (manifest.get("source") or {}).get("path")  # the convert's source, outside by design
    if isinstance(src, str) and src:
        try:
            card = read_regular(Path(src) / "README.md").decode("utf-8")
        except (OSError, UnicodeDecodeError, HetquantError):
            card = None
    for p in sorted(artifact.glob("LICENSE*")):
        if not is_inside(artifact, p):  # a link out of the artifact is not its licence
            continue
        try:
            license_file = read_regular(p).decode("utf-8", errors="replace")
            break
        except (OSError, HetquantError):
            continue
    return license_from_text(card, license_file, base_model)


def _recipe_summary(name: str) -> str | None:
    try:
        from ..recipes import get_recipe

        return get_recipe(name).summary
    except HetquantError:
        return None
