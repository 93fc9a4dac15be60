"""OS limits a convert runs into: one ``error:`` line naming the file (or what was being done),
exit 2, promptly — never ``(no path)``, never a hang. (Issue 25 §5.)

Limits are set in the child only (``preexec_fn``); its timeout guards against a hang and is no
performance threshold.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import subprocess
import sys
from pathlib import Path

from support import HETQUANT_MAIN, MANIFEST, PARTIAL, REPO, error_line, process_group

from hetquant.convert.engine import writer

BF16 = ("--recipe", "bf16")
HANG_GUARD = 300  # seconds


def _convert_limited(src: Path, out: Path, limit: int, value: int, *opts: str):
    def set_limit() -> None:
        os.setsid()  # its own process group: the test can see every process it left
        resource.setrlimit(limit, (value, resource.getrlimit(limit)[1]))

    args = [sys.executable, "-c", HETQUANT_MAIN, "convert", src, out, *BF16, *opts]
    return subprocess.Popen(
        list(map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, preexec_fn=set_limit,
    )  # fmt: skip


def test_too_few_file_descriptors_for_the_workers_exits_with_one_line(
    tiny_ro: Path, tmp_path: Path
) -> None:
    """``ulimit -n 16`` and ``--workers 2``: a pipe of the second worker fails; the first one,
    already started, must not keep the command waiting for it at exit."""
    out = tmp_path / "out"
    proc = _convert_limited(tiny_ro, out, resource.RLIMIT_NOFILE, 16, "--workers", "2")
    _, stderr = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 2, stderr
    line = error_line(stderr)
    assert "Too many open files" in line and "ulimit -n" in line and "(no path)" not in line
    assert line.startswith("error: (starting 2 worker processes): "), line
    assert process_group(proc.pid) == []  # no worker left behind
    assert not (out / MANIFEST).exists()


def test_a_file_size_limit_names_the_file(tiny_ro: Path, tmp_path: Path) -> None:
    """``ulimit -f``: sizing the first container past it fails with EFBIG (Python ignores
    SIGXFSZ)."""
    out = tmp_path / "out"
    proc = _convert_limited(tiny_ro, out, resource.RLIMIT_FSIZE, 1 << 20)
    _, stderr = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 2, stderr
    line = error_line(stderr)
    work_file = out / PARTIAL / "model-00001-of-00001.safetensors"
    assert line.startswith(f"error: {work_file}: File too large; "), line
    assert "ulimit -f" in line


class _NoSharedMaps(mmap.mmap):
    """``mmap`` failing with ENOMEM for shared (writable) maps, as under ``ulimit -v``: the
    workers' way of writing (forked: they inherit the patch)."""

    def __new__(cls, fd, length, *args, **kwargs):
        if args and args[0] == mmap.MAP_SHARED:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return super().__new__(cls, fd, length, *args, **kwargs)


def test_out_of_memory_mapping_a_container_names_it(
    cli, tiny_ro: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(writer.mmap, "mmap", _NoSharedMaps)
    monkeypatch.setenv(writer.WRITE_ENV, "mmap")  # the maps are the default on tmpfs only
    out = tmp_path / "out"
    res = cli("convert", tiny_ro, out, *BF16, "--workers", "2")
    assert res.exit_code == 2 and res.exception is None, res.stderr
    line = error_line(res.stderr)
    assert line.startswith(f"error: {out / PARTIAL}/model-00001-of-00001.safetensors: Cannot allocate memory; "), line  # fmt: skip
    assert "ulimit -v" in line
