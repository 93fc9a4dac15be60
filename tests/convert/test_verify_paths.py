"""``verify`` and ``publish`` on a manifest that names files outside the artifact, or a file that is
no regular file (issue 25 §1, §2): refused — one ``error:`` line, exit 2 — before anything is
hashed, listed, staged or sent; a download in the Hugging Face cache layout verifies."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import blake3
import pytest
from support import MANIFEST, hf_cache_snapshot, no_hang, read_json, write_json

from hetquant.convert.hub.upload import upload_artifact
from hetquant.formats import HetquantError

SECRET = b"TOPSECRET api key 0123456789\n"


def _name(art: Path, how: str) -> str:
    """A secret file beside the artifact, named as ``how`` says."""
    (art.parent / "secret.txt").write_bytes(SECRET)
    return "../secret.txt" if how == "dotdot" else str(art.parent / "secret.txt")


def _list(art: Path, name: str, *, part: bool = False) -> None:
    """List ``name`` in the manifest with its true size and digest (or in a part's files)."""
    doc = read_json(art / MANIFEST)
    if part:
        doc["parts"].setdefault("root", {"files": []})["files"].append(name)
    else:
        digest = blake3.blake3(SECRET).hexdigest()
        doc["files"][name] = {"size": len(SECRET), "blake3": digest}
    write_json(art / MANIFEST, doc)


def _one_error_line(res, *words: str) -> str:
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = [x for x in res.stderr.splitlines() if not x.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(w in lines[0] for w in words), lines
    assert "TOPSECRET" not in res.stdout + res.stderr and " OK" not in res.stdout
    return lines[0]


@pytest.mark.parametrize("part", [False, True], ids=["files", "parts"])
@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_verify_refuses_a_manifest_name_outside(artifact_copy: Path, cli, how, part) -> None:
    name = _name(artifact_copy, how)
    _list(artifact_copy, name, part=part)
    res = cli("verify", artifact_copy)
    _one_error_line(res, f"{MANIFEST}: file {name!r}", "outside the artifact")
    assert str(len(SECRET)) not in res.stdout  # its size was not looked at


def test_inspect_refuses_a_manifest_name_outside(artifact_copy: Path, cli) -> None:
    _list(artifact_copy, _name(artifact_copy, "dotdot"))
    _one_error_line(cli("inspect", artifact_copy), "'../secret.txt' points outside the artifact")


def test_verify_refuses_a_listed_link_out_of_the_artifact(artifact_copy: Path, cli) -> None:
    (artifact_copy.parent / "secret.txt").write_bytes(SECRET)
    os.symlink(artifact_copy.parent / "secret.txt", artifact_copy / "notes.txt")
    _list(artifact_copy, "notes.txt")
    _one_error_line(cli("verify", artifact_copy), "'notes.txt' is a link to", "outside")


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_publish_dry_run_lists_nothing_outside(artifact_copy: Path, cli, how) -> None:
    name = _name(artifact_copy, how)
    _list(artifact_copy, name)
    res = cli("publish", artifact_copy, "acme/x", "--dry-run", "--license", "mit")
    _one_error_line(res, "outside the artifact")
    assert "secret.txt" not in res.stdout


def test_upload_refuses_before_staging_or_sending(
    artifact_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real publish staged ``stage/../secret.txt`` — a link outside its staging directory, left
    behind. Now the names are checked before the repo is created or anything is staged."""
    name = _name(artifact_copy, "dotdot")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: nothing is sent
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(HetquantError, match=re.escape("file '../secret.txt' points outside")):
        upload_artifact(artifact_copy, "acme/x", ["config.json", name], "card", token="t")
    assert list(scratch.iterdir()) == [] and not (tmp_path / "secret.txt").is_symlink()


def test_verify_does_not_open_a_fifo(artifact_copy: Path, cli) -> None:
    shard = next(
        n for n in read_json(artifact_copy / MANIFEST)["files"] if n.endswith(".safetensors")
    )
    (artifact_copy / shard).unlink()
    os.mkfifo(artifact_copy / shard)
    with no_hang():
        res = cli("verify", artifact_copy)
    assert res.exit_code == 1, (res.stdout, res.stderr)
    assert f"FAIL {shard}: not a regular file" in res.stdout


def test_a_download_in_the_hub_cache_layout_verifies(tiny_artifact: Path, tmp_path: Path, cli):
    snap = hf_cache_snapshot(tiny_artifact, tmp_path / "hub")
    assert (snap / MANIFEST).is_symlink()
    res = cli("verify", snap)
    assert res.exit_code == 0 and ": OK (" in res.stdout, (res.stdout, res.stderr)


def test_publish_does_not_wait_on_a_fifo_as_the_source_card(
    artifact_copy: Path, tmp_path: Path, cli
) -> None:
    """The manifest's ``source.path`` (where the convert read from) is looked in for the model
    card's licence: a FIFO there is skipped, not waited on."""
    src = tmp_path / "source"
    src.mkdir()
    os.mkfifo(src / "README.md")
    doc = read_json(artifact_copy / MANIFEST)
    doc["source"]["path"] = str(src)
    write_json(artifact_copy / MANIFEST, doc)
    with no_hang():
        res = cli("publish", artifact_copy, "acme/x", "--dry-run")
    assert res.exit_code == 2 and "no license found" in res.stderr, res.stderr
