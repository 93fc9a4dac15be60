"""Out of inodes is not out of bytes: a file system that can create no more files (bytes to
spare) is reported as such, before the work and during it. (Issue 25 §5.)"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from support import MANIFEST, error_line, journal_jobs, tmpfs, tree_hashes, wait_for_jobs

from hetquant.convert.engine import convert as engine
from hetquant.convert.engine.writer import PieceWriter

BF16 = ("--recipe", "bf16")


def _one_error_line(res) -> str:
    assert res.exit_code == 2 and res.exception is None, (res.stdout, res.stderr)
    return error_line(res.stderr)


def test_too_few_inodes_is_refused_before_anything_is_written(
    cli, tiny_ro: Path, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "few", "64m", inodes=12) as few:
        line = _one_error_line(cli("convert", tiny_ro, few / "out", *BF16, "--max-shard-size", "1MB"))  # fmt: skip
        assert "no free inodes: its file system can create" in line
        assert "bytes are not the problem" in line and "not enough disk space" not in line
        assert list(few.iterdir()) == []


def test_inodes_running_out_during_the_run(
    cli, hetquant_proc, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path
) -> None:
    """Another writer takes every inode left while the jobs run: the finishing files cannot be
    created; once it is gone, the same command resumes and finishes."""
    with tmpfs(tmp_path / "fs", "64m", inodes=64) as fs:
        out = fs / "out"
        args = ["convert", tiny_ro, out, *BF16]
        proc = hetquant_proc(args, slow_jobs=0.05)
        wait_for_jobs(proc, out, 5)
        fillers = fs / "fillers"
        fillers.mkdir()
        try:
            for i in range(1000):
                (fillers / str(i)).touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        _, stderr = proc.communicate(timeout=300)  # a hang guard
        assert proc.returncode == 2, stderr
        line = error_line(stderr)
        assert "no free inodes (they ran out during the run)" in line, line
        assert not (out / MANIFEST).exists() and journal_jobs(out)
        for p in fillers.iterdir():
            p.unlink()
        res = cli(*args)
        assert res.exit_code == 0, res.stderr
        assert tree_hashes(out) == tree_hashes(tiny_artifact)


def test_inodes_running_out_simulated(cli, tiny_ro: Path, tmp_path: Path, monkeypatch) -> None:
    """The same without a mount: ENOSPC from a write while statvfs says no file can be made."""
    real, calls = PieceWriter.write, []

    def write(self, tensor: str, offset: int, data) -> None:
        calls.append(offset)
        if len(calls) > 40:
            monkeypatch.setattr(engine, "free_inodes", lambda path: 0)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, tensor, offset, data)

    monkeypatch.setattr(PieceWriter, "write", write)
    line = _one_error_line(cli("convert", tiny_ro, tmp_path / "out", *BF16))
    assert "no free inodes (they ran out during the run): its file system can create 0 more files" in line  # fmt: skip
