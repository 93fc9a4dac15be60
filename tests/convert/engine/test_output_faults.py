"""What OUTPUT can do to a convert: fill up, be read-only or a file, fail with any OS error, be
taken by another convert, hold an artifact to overwrite or the finished artifact itself. Each
ends in exit 0 or in one ``error:`` line with exit 2, and nothing is lost: the journal resumes,
a previous artifact stays valid. (Issue 17, items 1, 2, 3, 6, 7.)"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from support import (
    MANIFEST,
    PARTIAL,
    error_line,
    journal_jobs,
    read_json,
    resave_shard,
    shard_of,
    tmpfs,
    tree_hashes,
    wait_for_jobs,
)

from hetquant.convert.engine import convert as engine
from hetquant.convert.engine import finalize
from hetquant.convert.engine.writer import PieceWriter
from hetquant.convert.fs import lock as output_lock
from hetquant.convert.fs.lock import LOCK_NAME, OutputLock
from hetquant.convert.planning import containers
from hetquant.convert.verify import artifact_files, count_files
from hetquant.formats import HetquantError

BF16 = ("--recipe", "bf16")


def _one_error_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert res.exception is None, repr(res.exception)
    return lines[0]


def _planned_bytes(cli, src: Path, *opts: str) -> int:
    res = cli("convert", src, "/nonexistent/dry", *BF16, *opts, "--dry-run")
    return int(re.search(r"total output: ([\d,]+) bytes", res.stdout)[1].replace(",", ""))


def _needs_and_free(line: str) -> tuple[int, int]:
    m = re.search(r"needs ([\d,]+) more bytes, ([\d,]+) free", line)
    assert m, line
    return int(m[1].replace(",", "")), int(m[2].replace(",", ""))


# ----------------------------------------------------------------------------------------------
# 1. disk full


def test_too_little_space_is_refused_before_anything_is_written(
    cli, tiny_ro: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(engine, "free_bytes", lambda path: 1_000_000)
    out = tmp_path / "out"
    line = _one_error_line(cli("convert", tiny_ro, out, *BF16))
    need, free = _needs_and_free(line)
    assert free == 1_000_000
    assert need >= _planned_bytes(cli, tiny_ro)  # every container, plus the JSON and tokenizer
    assert "re-run the same command" in line
    assert not out.exists()  # it created OUTPUT, and took it away again


def test_disk_filling_up_mid_run_is_one_line_and_resumes(
    cli, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path, monkeypatch
) -> None:
    """ENOSPC from a job's write (simulated: the same OSError a full disk raises)."""
    real, calls = PieceWriter.write, []

    def write(self, tensor: str, offset: int, data) -> None:
        calls.append(offset)
        if len(calls) > 40:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, tensor, offset, data)

    monkeypatch.setattr(PieceWriter, "write", write)
    out = tmp_path / "out"
    line = _one_error_line(cli("convert", tiny_ro, out, *BF16))
    assert "the disk filled up during the run" in line
    need, free = _needs_and_free(line)
    assert need > 0 and free > 0
    assert 0 < len(journal_jobs(out)) and not (out / MANIFEST).exists()
    monkeypatch.undo()
    res = cli("convert", tiny_ro, out, *BF16)
    assert res.exit_code == 0, res.stderr
    assert "already done (resume)" in res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact)


def test_full_tmpfs_up_front_then_filled_during_the_run(
    cli, hetquant_proc, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path
) -> None:
    """A real file system: first too small for the artifact; then big enough, but filled by
    another writer during the run (on tmpfs the containers are sized, not reserved, so a job's
    page populate (EFAULT, reported as ENOSPC) or the finishing writes fail); after the filler
    goes, the same command resumes and finishes."""
    with tmpfs(tmp_path / "small", "3m") as small:
        line = _one_error_line(cli("convert", tiny_ro, small / "out", *BF16))
        need, free = _needs_and_free(line)
        assert free <= 3 << 20 < _planned_bytes(cli, tiny_ro) <= need
        assert list(small.iterdir()) == []
    with tmpfs(tmp_path / "fits", "24m") as fits:
        out = fits / "out"
        args = ["convert", tiny_ro, out, *BF16]
        proc = hetquant_proc(args, slow_jobs=0.05)
        wait_for_jobs(proc, out, 5)
        filler = fits / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:  # every block that is left
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, stderr
        assert "the disk filled up during the run" in error_line(stderr)
        assert not (out / MANIFEST).exists()
        filler.unlink()
        res = cli(*args)
        assert res.exit_code == 0, res.stderr
        assert tree_hashes(out) == tree_hashes(tiny_artifact)


# ----------------------------------------------------------------------------------------------
# 2. OUTPUT unwritable, a file, or any other OS error


def test_output_on_a_read_only_file_system(cli, tiny_ro: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        line = _one_error_line(cli("convert", tiny_ro, ro / "out", *BF16))
        assert str(ro / "out") in line and "Read-only file system" in line
        assert "writable" in line


@pytest.mark.parametrize("where", ["output", "parent"])
def test_output_that_is_a_file(cli, tiny_ro: Path, tmp_path: Path, where: str) -> None:
    (tmp_path / "f").write_text("mine")
    out = tmp_path / "f" if where == "output" else tmp_path / "f" / "out"
    line = _one_error_line(cli("convert", tiny_ro, out, *BF16))
    assert str(tmp_path / "f") in line
    assert ("is a file, not a directory" if where == "output" else "Not a directory") in line
    assert (tmp_path / "f").read_text() == "mine"


def test_any_os_error_is_one_line_naming_the_path(
    cli, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path, monkeypatch
) -> None:
    def broken(path: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(containers.Container, "create", lambda self, path: broken(path))
    out = tmp_path / "out"
    line = _one_error_line(cli("convert", tiny_ro, out, *BF16))
    assert re.fullmatch(rf"error: {re.escape(str(out / PARTIAL))}/model-\S+: Input/output error; .*check it.*", line)  # fmt: skip
    monkeypatch.undo()
    assert cli("convert", tiny_ro, out, *BF16).exit_code == 0
    assert tree_hashes(out) == tree_hashes(tiny_artifact)


# ----------------------------------------------------------------------------------------------
# 3. two converts into one OUTPUT


@pytest.mark.parametrize("recipe", ["bf16", "ascend-w8a8"])
def test_second_convert_into_a_busy_output_is_refused(
    cli, hetquant_proc, tiny_ro: Path, tiny_artifact_1mb: Path, tmp_path: Path, recipe: str
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, *BF16, "--max-shard-size", "1MB"]
    proc = hetquant_proc(args, slow_jobs=0.1)
    wait_for_jobs(proc, out, 3)
    journal = (out / PARTIAL / "journal").read_text()
    line = _one_error_line(cli("convert", tiny_ro, out, "--recipe", recipe, "--max-shard-size", "1MB"))  # fmt: skip
    assert line == f"error: OUTPUT {out} is in use by PID {proc.pid} (another hetquant convert); wait for it to finish, or stop it and re-run"  # fmt: skip
    assert (out / PARTIAL / "journal").read_text().startswith(journal)  # the loser touched nothing
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact_1mb)  # lock and work directory gone


def test_lock_file_removed_under_a_waiting_convert_is_taken_afresh(
    tmp_path: Path, monkeypatch
) -> None:
    """The owner finishes (removing its lock file) just after a second convert opened that file:
    the second must not trust a lock on a file no longer at the path."""
    out = tmp_path / "out"
    owner = OutputLock(out).acquire()
    real_open, opened = os.open, []

    def racing_open(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if Path(path).name == LOCK_NAME:
            opened.append(path)
            if len(opened) == 1:  # the owner unlinks the file just opened, removes the dirs
                owner.release(remove=True)
        return fd

    monkeypatch.setattr(output_lock.os, "open", racing_open)
    second = OutputLock(out).acquire()
    monkeypatch.undo()
    assert len(opened) == 2  # the lock on the removed file was dropped, a new file locked
    assert second.path.read_text().split()[0] == str(os.getpid())
    with pytest.raises(HetquantError, match=rf"OUTPUT {re.escape(str(out))} is in use by PID {os.getpid()} "):  # fmt: skip
        OutputLock(out).acquire()
    second.release(remove=True)
    assert list(out.iterdir()) == []  # lock file and work directory gone


def test_file_system_without_locks_converts_with_a_warning(
    cli, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path, monkeypatch
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(output_lock.fcntl, "flock", no_locks)
    out = tmp_path / "out"
    res = cli("convert", tiny_ro, out, *BF16)
    assert res.exit_code == 0, res.stderr
    warning = f"{out / PARTIAL / LOCK_NAME}: this file system cannot lock (No locks available)"
    assert res.stderr.splitlines() == [
        f"WARNING hetquant.convert: {warning}; make sure no other convert writes into OUTPUT"
    ]
    assert tree_hashes(out) == tree_hashes(tiny_artifact)


# ----------------------------------------------------------------------------------------------
# 6. --overwrite keeps the previous artifact valid until the new one is complete


def test_overwrite_failing_mid_way_leaves_the_old_artifact_valid(
    cli, tiny_src: Path, artifact_copy: Path
) -> None:
    name = "model.layers.2.mlp.experts.3.up_proj.weight"  # late in the plan: many jobs first

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name].view(torch.uint8)[7, 9] = 0x7F  # an FP8 NaN

    resave_shard(shard_of(tiny_src, name), poison)
    before = tree_hashes(artifact_copy)
    res = cli("convert", tiny_src, artifact_copy, *BF16, "--max-shard-size", "1MB", "--overwrite")
    assert name in _one_error_line(res)
    assert len(journal_jobs(artifact_copy)) > 50
    after = tree_hashes(artifact_copy)
    assert {k: v for k, v in after.items() if not k.startswith(PARTIAL)} == before
    assert cli("verify", artifact_copy).exit_code == 0


def test_overwrite_killed_keeps_the_old_artifact_and_resumes(
    cli, hetquant_proc, tiny_ro: Path, artifact_copy: Path, tiny_artifact_1mb: Path
) -> None:
    before = tree_hashes(artifact_copy)
    args = ["convert", tiny_ro, artifact_copy, *BF16, "--max-shard-size", "1MB", "--overwrite"]
    proc = hetquant_proc(args, slow_jobs=0.1)
    wait_for_jobs(proc, artifact_copy, 5)
    os.killpg(proc.pid, 9)
    proc.wait()
    after = tree_hashes(artifact_copy)
    assert {k: v for k, v in after.items() if not k.startswith(PARTIAL)} == before
    assert cli("verify", artifact_copy).exit_code == 0
    # without --overwrite the old artifact is not replaced, and the interrupted work is kept
    res = cli(*args[:-1])
    assert "pass --overwrite to resume it" in _one_error_line(res)
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "already done (resume)" in res.stderr
    assert tree_hashes(artifact_copy) == tree_hashes(tiny_artifact_1mb)


class Interrupt(BaseException):
    pass


def test_interrupted_move_into_output_is_finished_by_a_rerun(
    cli, tiny_ro: Path, artifact_copy: Path, tiny_artifact_1mb: Path, monkeypatch
) -> None:
    """Killed while the new artifact replaces the old one: OUTPUT is no artifact (no manifest)
    until a re-run finishes the move; old files the new artifact lacks are removed."""
    real, moved = os.replace, []

    def replace(src, dst) -> None:
        if Path(dst).parent == artifact_copy and Path(src).parent.name == PARTIAL:
            if len(moved) == 3:
                raise Interrupt
            moved.append(dst)
        real(src, dst)

    monkeypatch.setattr(finalize.os, "replace", replace)
    args = ["convert", tiny_ro, artifact_copy, *BF16, "--max-shard-size", "1MB", "--overwrite"]
    with pytest.raises(Interrupt):
        cli(*args)
    monkeypatch.undo()
    assert not (artifact_copy / MANIFEST).exists()
    assert cli("verify", artifact_copy).exit_code == 2
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(artifact_copy) == tree_hashes(tiny_artifact_1mb)


# ----------------------------------------------------------------------------------------------
# 7. a finished command run again


def test_rerun_of_a_finished_command_is_already_complete(
    cli, tiny_ro: Path, artifact_copy: Path, tiny_artifact: Path
) -> None:
    before = {p: p.stat().st_mtime_ns for p in artifact_copy.rglob("*")}
    res = cli("convert", tiny_ro, artifact_copy, *BF16)
    assert res.exit_code == 0, res.stderr
    n = count_files(artifact_files(artifact_copy, read_json(artifact_copy / MANIFEST)))
    assert res.stdout.splitlines()[0] == f"{artifact_copy}: already complete ({n}; same source, recipe and options)"  # fmt: skip
    assert {p: p.stat().st_mtime_ns for p in artifact_copy.rglob("*")} == before  # untouched
    # a damaged one is not "complete": refused, pointing at verify
    shutil.copyfile(artifact_copy / "config.json", artifact_copy / "tokenizer.json")
    line = _one_error_line(cli("convert", tiny_ro, artifact_copy, *BF16))
    assert "damaged artifact (run `hetquant verify`)" in line and "--overwrite" in line
    # --overwrite always converts again
    res = cli("convert", tiny_ro, artifact_copy, *BF16, "--overwrite")
    assert res.exit_code == 0 and res.stdout.startswith("wrote "), res.stderr
    assert tree_hashes(artifact_copy) == tree_hashes(tiny_artifact)


def test_a_different_recipe_into_a_finished_output_still_needs_overwrite(
    cli, tiny_ro: Path, artifact_copy: Path
) -> None:
    before = tree_hashes(artifact_copy)
    line = _one_error_line(cli("convert", tiny_ro, artifact_copy, "--recipe", "ascend-w8a8"))
    assert "already holds an artifact of another source, recipe or options" in line
    assert tree_hashes(artifact_copy) == before
