"""The command line's shared policy: usage errors and OS errors as one ``error:`` line (exit 2),
``--help`` / ``--version``, ``-v`` after the command, ``--workers`` capped to the cores, one
count of an artifact's files, and ``inspect``'s wording."""

from __future__ import annotations

import os
import re
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
from support import MANIFEST, PARTIAL, read_json, write_json

from hetquant.convert.engine.manifest import format_precision


def _one_error_line(res, *words: str) -> str:
    lines = res.stderr.splitlines()
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(w in lines[0] for w in words), lines
    return lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["convert", "SRC"], ["Missing argument 'OUTPUT'", "hetquant convert --help"]),
        (["convert", "SRC", "OUT"], ["Missing option '--recipe'"]),
        (["convert", "SRC", "OUT", "--recipe", "bf16", "--workers", "0"], ["--workers", "0"]),
        (["convert", "SRC", "OUT", "--recipe", "bf16", "--mtp", "maybe"], ["--mtp", "maybe"]),
        (["--bogus"], ["No such option '--bogus'", "hetquant --help"]),
        (["nosuch"], ["No such command 'nosuch'"]),
        (["run", "ART"], ["Missing option '--tokens'", "hetquant run --help"]),
        (["run", "ART", "--tokens", "1", "--tp", "x"], ["--tp", "'x'"]),
        (["eval", "ART", "--text", "T"], ["Missing option '--reference'"]),
        (["verify"], ["Missing argument 'ARTIFACT'"]),
        (["inspect", "A", "B"], ["unexpected extra argument (B)"]),
        (["publish", "/nonexistent-artifact", "org/x"], ["ARTIFACT", "does not exist"]),
        (["recipes", "--nope"], ["No such option '--nope'", "hetquant recipes --help"]),
    ],
)
def test_usage_errors_are_one_line(cli, args: list[str], words: list[str]) -> None:
    res = cli(*args)
    _one_error_line(res, *words)
    assert res.stdout == ""


def test_help_and_version(cli) -> None:
    for args in (["--help"], ["convert", "--help"], ["run", "--help"], ["publish", "--help"]):
        res = cli(*args)
        assert res.exit_code == 0 and res.stdout.startswith("Usage: hetquant"), args
        assert "-v, --verbose" in res.stdout, args  # every command takes -v
    res = cli("--version")
    assert res.exit_code == 0 and res.stdout == f"hetquant {version('hetquant')}\n"


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_before_or_after_the_command(cli, tmp_path: Path, where: str) -> None:
    missing = tmp_path / "nope"
    args = ["-v", "verify", missing] if where == "before" else ["verify", missing, "-v"]
    res = cli(*args)
    assert res.exit_code == 2
    assert "Traceback" in res.stderr  # -v: the traceback, then the one line
    assert res.stderr.splitlines()[-1] == f"error: {missing}: no such file or directory"


def test_readme_convert_synopsis_with_v_after(cli, tiny_ro: Path, tmp_path: Path) -> None:
    res = cli("convert", tiny_ro, tmp_path / "o", "--recipe", "bf16", "--dry-run", "-v")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.startswith("plan: ")


def test_workers_beyond_the_cores_are_capped_with_a_warning(
    cli, tiny_ro: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    res = cli("convert", tiny_ro, tmp_path / "o", "--recipe", "bf16", "--dry-run", "--workers", 64)
    assert res.exit_code == 0, res.stderr
    assert "warning: --workers 64 capped to 2, the CPU cores available here" in res.stderr
    assert "≈ 2 × " in res.stdout  # the plan's memory line uses the capped count
    res = cli("convert", tiny_ro, tmp_path / "o", "--recipe", "bf16", "--dry-run", "--workers", 2)
    assert res.exit_code == 0 and "warning" not in res.stderr


# ----------------------------------------------------------------------------------------------
# one count of an artifact's files


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(an ascend-hybrid artifact, the output of the convert that wrote it)."""
    from support import TINY, run_cli

    out = tmp_path_factory.mktemp("hyb") / "hybrid"
    res = run_cli("convert", TINY, out, "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    return out, res.stdout


def test_convert_inspect_verify_publish_count_the_same_files(cli, hybrid) -> None:
    art, convert_out = hybrid
    on_disk = [p for p in art.rglob("*") if p.is_file()]
    n, size = len(on_disk), sum(p.stat().st_size for p in on_disk)
    counted = f"{n} files, {size:,} bytes"
    assert f"wrote {art} ({counted})" in convert_out
    assert re.search(rf"^files\s+{re.escape(counted)} \(root 7, cpu_experts 3, {MANIFEST}\)$",
                     cli("inspect", art).stdout, re.M)  # fmt: skip
    assert cli("verify", art).stdout == f"{art}: OK ({counted})\n"
    res = cli("publish", art, "acme/x", "--dry-run", "--license", "mit")
    assert res.exit_code == 0, res.stderr
    assert f"verified {art}: {counted} OK" in res.stdout
    assert f"--- the artifact's {n} files and README.md: " in res.stdout


# ----------------------------------------------------------------------------------------------
# inspect


def test_inspect_names_a_missing_manifest(cli, hybrid, tmp_path: Path) -> None:
    art = tmp_path / "art"
    shutil.copytree(hybrid[0], art)
    (art / MANIFEST).unlink()
    line = _one_error_line(cli("inspect", art), f"{art}: no {MANIFEST}", "not a (complete)")
    assert line.index(MANIFEST) < line.index("config.json")  # the manifest first, then why
    (art / PARTIAL).mkdir()
    _one_error_line(cli("inspect", art), f"no {MANIFEST}", "did not finish", "re-run")


def test_inspect_revision_only_when_there_is_one(cli, hybrid, tmp_path: Path) -> None:
    res = cli("inspect", hybrid[0])
    assert res.exit_code == 0 and "None" not in res.stdout and "revision" not in res.stdout
    art = tmp_path / "art"
    shutil.copytree(hybrid[0], art)
    m = read_json(art / MANIFEST)
    m["source"].update(revision="0123abc", repo_id="deepseek-ai/Tiny")
    write_json(art / MANIFEST, m)
    src = re.search(r"^source\s+(.*)$", cli("inspect", art).stdout, re.M)
    assert (
        src
        and src[1]
        == f"deepseek-ai/Tiny (revision 0123abc, fingerprint {m['source']['fingerprint'][:12]})"
    )


def test_precision_table_columns_line_up_in_one_case(cli, hybrid) -> None:
    table = read_json(hybrid[0] / MANIFEST)["precision"]
    assert any(len(g["format"]) > 26 for g in table["groups"])  # the mtp row of the hybrid
    assert {"BF16", "bf16"} <= {p for g in table["groups"] for p in g["format"].split("+")}
    lines = format_precision(table).splitlines()
    assert len({len(line) for line in lines}) == 1  # every column ends where the header's does
    formats = [line.split()[1] for line in lines[1:-1]]
    assert all(f == f.lower() for f in formats)
    assert all(len(f.split("+")) == len(set(f.split("+"))) for f in formats)
    mtp = next(line for line in lines if line.startswith("mtp "))
    assert mtp.split()[1] == "bf16+f32+int4_cpu_experts+w8a8_dynamic"


# ----------------------------------------------------------------------------------------------
# OS errors: one line, exit 2, in every command


@pytest.mark.parametrize("command", ["verify", "inspect", "run", "publish"])
def test_an_os_error_is_one_line(cli, hybrid, tmp_path: Path, command: str) -> None:
    art = tmp_path / "art"
    shutil.copytree(hybrid[0], art)
    (art / MANIFEST).unlink()
    (art / MANIFEST).mkdir()  # reading it: IsADirectoryError
    extra = {"run": ["--tokens", "1"], "publish": ["acme/x", "--dry-run", "--license", "mit"]}
    res = cli(command, art, *extra.get(command, []))
    _one_error_line(res, f"{art / MANIFEST}: Is a directory")


def test_an_os_error_in_eval_is_one_line(cli, hybrid, tiny_ro: Path, tmp_path: Path) -> None:
    res = cli("eval", hybrid[0], "--reference", tiny_ro, "--text", tmp_path)
    _one_error_line(res, f"{tmp_path}: Is a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
@pytest.mark.parametrize("command", ["verify", "inspect", "run", "publish"])
def test_an_unreadable_file_is_one_line(cli, hybrid, tmp_path: Path, command: str) -> None:
    art = tmp_path / "art"
    shutil.copytree(hybrid[0], art)
    (art / MANIFEST).chmod(0)
    extra = {"run": ["--tokens", "1"], "publish": ["acme/x", "--dry-run", "--license", "mit"]}
    _one_error_line(cli(command, art, *extra.get(command, [])), "Permission denied")
