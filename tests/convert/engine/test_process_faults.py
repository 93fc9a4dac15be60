"""What can happen to a running convert's processes and to its source: the command killed or
stopped (its workers must die with it, the journal must resume), the source edited, replaced or
truncated under it (one line, no manifest; the re-run redoes what read the changed files).
(Issue 17, items 4 and 5.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from support import (
    MANIFEST,
    PARTIAL,
    error_line,
    journal_jobs,
    process_group,
    rewrite_header,
    shard_of,
    st_header,
    tiny_counts,
    tree_hashes,
    wait_for_jobs,
)

from hetquant.convert.engine import jobs

ARGS_1MB = ("--recipe", "bf16", "--max-shard-size", "1MB")


def _group_ends(pgid: int) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a performance threshold
    while left := process_group(pgid):
        assert time.monotonic() < deadline, f"still alive after the convert died: {left}"
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# 4. the command killed or stopped


def test_sigkill_of_the_command_takes_its_workers_and_tracker_along(
    cli, hetquant_proc, tiny_ro: Path, tiny_artifact_1mb: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, *ARGS_1MB, "--workers", "2"]
    proc = hetquant_proc(args, slow_jobs=0.2)
    wait_for_jobs(proc, out, 5)
    assert len(process_group(proc.pid)) >= 3  # the command, 2 workers (and a resource tracker)
    os.kill(proc.pid, signal.SIGKILL)  # the command only, as an OOM kill would
    proc.wait()
    _group_ends(proc.pid)
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "already done (resume)" in res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact_1mb)


@pytest.mark.parametrize(("sig", "workers"), [(signal.SIGTERM, 2), (signal.SIGINT, 1)])
def test_sigterm_or_sigint_stops_cleanly_and_resumes(
    cli, hetquant_proc, tiny_ro: Path, tiny_artifact_1mb: Path, tmp_path: Path, sig, workers
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, *ARGS_1MB, "--workers", str(workers)]
    proc = hetquant_proc(args, slow_jobs=0.2)
    wait_for_jobs(proc, out, 5)
    os.kill(proc.pid, sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    line = error_line(stderr)
    done = len(journal_jobs(out))
    assert line == (
        f"error: interrupted by {sig.name}: {done} of {tiny_counts(tiny_ro)[0]} jobs are done and "
        f"journaled in {out / PARTIAL}; re-run the same command to resume"
    )
    _group_ends(proc.pid)
    assert not (out / MANIFEST).exists()
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert f"{done} already done (resume)" in res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact_1mb)


# ----------------------------------------------------------------------------------------------
# 5. the source changed under the convert


def _edited(src: Path, name: str) -> bytes:
    """The bytes of ``name``'s shard with other valid FP8 codes in the tensor's first 64 bytes."""
    path = shard_of(src, name)
    start, header = st_header(path)
    at = start + header[name]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[at : at + 64] = bytes((b + 1) % 0x7E for b in data[at : at + 64])  # 0..0x7D: no NaN
    return bytes(data)


def _edit_in_place(src: Path, name: str) -> None:
    """Other FP8 bytes written into the shard itself (same file and size, new mtime)."""
    data = _edited(src, name)
    with shard_of(src, name).open("r+b") as f:
        f.write(data)


@pytest.mark.parametrize("workers", [1, 2])
def test_source_edited_during_convert_is_refused_and_rerun_redoes_its_jobs(
    cli, hetquant_proc, tiny_src: Path, tmp_path: Path, workers: int
) -> None:
    """Today's worst case: other valid FP8 bytes written into a shard mid-run gave exit 0 and an
    artifact mixing old and new data. Now: one line, no manifest; the re-run redoes the jobs that
    read the shard and gives exactly the artifact of the edited source."""
    out = tmp_path / "out"
    args = ["convert", tiny_src, out, *ARGS_1MB, "--workers", str(workers)]
    proc = hetquant_proc(args, slow_jobs=0.2)
    wait_for_jobs(proc, out, 5)
    _edit_in_place(tiny_src, "model.layers.0.self_attn.q_a_proj.weight")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    line = error_line(stderr)
    assert line.startswith("error: SOURCE changed during conversion: ")
    assert str(shard_of(tiny_src, "model.layers.0.self_attn.q_a_proj.weight")) in line
    assert not (out / MANIFEST).exists()
    _group_ends(proc.pid)

    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "changed since the interrupted run; redoing" in res.stderr
    fresh = tmp_path / "fresh"
    assert cli("convert", tiny_src, fresh, *ARGS_1MB).exit_code == 0
    assert tree_hashes(out) == tree_hashes(fresh)


class Interrupt(BaseException):
    pass


def test_resume_redoes_jobs_whose_source_shard_changed_in_between(
    cli, tiny_src: Path, tmp_path: Path, monkeypatch
) -> None:
    """Interrupted, then a shard is re-downloaded (replaced by another file with other bytes, same
    index and config): the resume must not trust the jobs that read the old file."""
    out = tmp_path / "out"
    args = ["convert", tiny_src, out, "--recipe", "bf16"]
    real, calls = jobs.JobRunner.run, []

    def run(self, job):
        if len(calls) == 60:
            raise Interrupt
        calls.append(job.id)
        return real(self, job)

    monkeypatch.setattr(jobs.JobRunner, "run", run)
    with pytest.raises(Interrupt):
        cli(*args)
    monkeypatch.undo()
    name = "model.layers.0.self_attn.q_a_proj.weight"
    shard = shard_of(tiny_src, name)
    incoming = shard.with_name("incoming")
    incoming.write_bytes(_edited(tiny_src, name))
    os.replace(incoming, shard)
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "1 source file(s) changed since the interrupted run" in res.stderr
    fresh = tmp_path / "fresh"
    assert cli("convert", tiny_src, fresh, "--recipe", "bf16").exit_code == 0
    assert tree_hashes(out) == tree_hashes(fresh)


@pytest.mark.parametrize("workers", [1, 2])
def test_shard_truncated_under_its_memory_map_is_one_line(
    hetquant_proc, tiny_src: Path, tmp_path: Path, workers: int
) -> None:
    """The read of a shard emptied after the engine checked it hits SIGBUS: in a worker, the
    worker dies and the command reports the changed source; in the command itself, its SIGBUS
    handler prints the line and exits 2. No 'Bus error', no traceback, no manifest."""
    out = tmp_path / "out"
    shard = shard_of(tiny_src, "model.layers.1.self_attn.q_a_proj.weight")
    args = ["convert", tiny_src, out, *ARGS_1MB, "--workers", str(workers)]
    proc = hetquant_proc(args, truncate=shard)
    _, stderr = proc.communicate(timeout=300)
    assert shard.stat().st_size == 0  # the hook did truncate it
    assert proc.returncode == 2, stderr
    line = error_line(stderr)
    if workers == 1:  # the command's own SIGBUS handler
        assert line.startswith(f"error: SOURCE {tiny_src} changed during conversion: a shard was truncated while it was being read (SIGBUS)")  # fmt: skip
    else:  # the worker's SIGBUS death explained by the parent; or, if the other worker's check
        # of the same shard reported first, that check's line
        assert line.startswith(f"error: SOURCE changed during conversion: {shard} changed size from ")  # fmt: skip
        assert line.endswith(("(a worker died reading it: SIGBUS)", "changed files are redone)"))
    assert "re-run the same command" in line
    assert not (out / MANIFEST).exists()
    _group_ends(proc.pid)


def test_header_only_change_of_a_shard_is_caught_before_the_manifest(
    cli, tiny_src: Path, tmp_path: Path, monkeypatch
) -> None:
    """A change after the last job (here: between the jobs and the manifest) still stops it."""
    from hetquant.convert.engine import finalize

    real = finalize.write_json_atomic
    name = "model.norm.weight"

    def write_json_atomic(path: Path, doc) -> None:
        if path.name == "config.json":  # the jobs are done, the manifest not yet written
            rewrite_header(
                shard_of(tiny_src, name), lambda h: h["__metadata__"].update(format="PT")
            )
        real(path, doc)

    monkeypatch.setattr(finalize, "write_json_atomic", write_json_atomic)
    out = tmp_path / "out"
    res = cli("convert", tiny_src, out, "--recipe", "bf16")
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith(f"error: SOURCE changed during conversion: {shard_of(tiny_src, name)} was modified")  # fmt: skip
    assert not (out / MANIFEST).exists()


def test_workers_killed_like_by_the_oom_killer_is_one_line_and_resumes(
    cli, hetquant_proc, tiny_ro: Path, tiny_artifact_1mb: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, *ARGS_1MB, "--workers", "2"]
    proc = hetquant_proc(args, kill_workers="SIGKILL")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert error_line(stderr) == (
        "error: a worker process died (SIGKILL, e.g. the out-of-memory killer); if it was killed "
        "for memory, use fewer --workers. Finished jobs are journaled: re-run the same command to "
        "resume"
    )
    _group_ends(proc.pid)
    assert not (out / MANIFEST).exists()
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact_1mb)
