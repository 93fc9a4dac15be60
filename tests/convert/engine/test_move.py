"""Moving a finished artifact into OUTPUT (``convert/engine/move.py``): nothing of the user's is
lost, and nothing is destroyed before the move is known to work. (Issue 25 §4, items 2 and 3.)"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from support import MANIFEST, PARTIAL, error_line, read_json, start_hetquant, tree_hashes

from hetquant.convert.engine import move
from hetquant.formats import HetquantError

BF16 = ("--recipe", "bf16")
USER = {"LICENSE": "my licence\n", "NOTES.txt": "my notes\n"}


def _add_user_files(out: Path) -> None:
    for name, text in USER.items():
        (out / name).write_text(text)


def _artifact_tree(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(out).items() if not k.startswith(PARTIAL)}


def _one_error_line(res) -> str:
    assert res.exit_code == 2 and res.exception is None, (res.stdout, res.stderr)
    return error_line(res.stderr)


def test_convert_overwrite_keeps_the_users_files(
    cli, tiny_ro: Path, artifact_copy: Path, tiny_artifact_1mb: Path
) -> None:
    _add_user_files(artifact_copy)
    res = cli("convert", tiny_ro, artifact_copy, *BF16, "--max-shard-size", "1MB", "--overwrite")
    assert res.exit_code == 0, res.stderr
    want = tree_hashes(tiny_artifact_1mb) | {n: _sha(t) for n, t in USER.items()}
    assert tree_hashes(artifact_copy) == want  # the old single shard gone, the user's files kept
    res = cli("verify", artifact_copy)  # a LICENSE is no problem: publish uploads it
    assert res.exit_code == 0, res.stdout
    assert res.stdout.splitlines()[-1] == "beside it, not part of it (not checked): LICENSE, NOTES.txt"  # fmt: skip


def test_export_overwrite_keeps_the_users_files(cli, tiny_hybrid: Path, tmp_path: Path) -> None:
    out = tmp_path / "kt"
    assert cli("export", tiny_hybrid, out, "--to", "kt-amxint4").exit_code == 0
    _add_user_files(out)
    res = cli("export", tiny_hybrid, out, "--to", "kt-amxint4", "--numa", "2", "--overwrite")
    assert res.exit_code == 0, res.stderr
    assert {n: (out / n).read_text() for n in USER} == USER
    assert set(read_json(out / MANIFEST)["files"]) | {MANIFEST, *USER} == set(tree_hashes(out))
    assert cli("verify", out).exit_code == 0


def test_a_users_file_the_new_artifact_would_replace_is_refused_before_any_work(
    cli, tiny_src: Path, artifact_copy: Path
) -> None:
    (tiny_src / "LICENSE").write_text("the source's licence\n")  # carried into the artifact
    _add_user_files(artifact_copy)
    before = tree_hashes(artifact_copy)
    res = cli("convert", tiny_src, artifact_copy, *BF16, "--overwrite")
    line = _one_error_line(res)
    assert "LICENSE is not part of the artifact there" in line and "move it away" in line
    assert tree_hashes(artifact_copy) == before  # no work began: not even a journal
    (tiny_src / "LICENSE").write_text(USER["LICENSE"])  # the same bytes: nothing is lost
    res = cli("convert", tiny_src, artifact_copy, *BF16, "--overwrite")
    assert res.exit_code == 0, res.stderr
    assert "LICENSE" in read_json(artifact_copy / MANIFEST)["files"]


def _other_filesystem(near: Path) -> Path:
    for d in (Path("/dev/shm"), Path("/run")):
        if d.is_dir() and os.access(d, os.W_OK) and d.stat().st_dev != near.stat().st_dev:
            return d
    pytest.skip("no writable directory on another file system here (/dev/shm, /run)")


def test_cpu_experts_on_another_file_system_is_refused_before_anything_changes(
    cli, tiny_ro: Path, tiny_hybrid: Path, tmp_path: Path
) -> None:
    """A real cross-device link: ``cpu_experts/`` moved to another file system, linked back."""
    art = tmp_path / "hybrid"
    shutil.copytree(tiny_hybrid, art)
    far = Path(_other_filesystem(tmp_path)) / f"hetquant-test-{os.getpid()}-{tmp_path.name}"
    shutil.move(art / "cpu_experts", far)
    try:
        (art / "cpu_experts").symlink_to(far, target_is_directory=True)
        before = tree_hashes(far) | _artifact_tree(art)
        res = cli("convert", tiny_ro, art, "--recipe", "ascend-hybrid", "--max-shard-size", "1MB", "--overwrite")  # fmt: skip
        line = _one_error_line(res)
        assert "cpu_experts is on another file system than OUTPUT" in line, line
        assert "nothing in OUTPUT was changed" in line
        assert tree_hashes(far) | _artifact_tree(art) == before  # the old artifact is whole
        # ... and, as every name that leads out of the artifact, refused by verify and load
        # (formats/safe_paths.py): the user moves cpu_experts/ back, it verifies again
        res = cli("verify", art)
        assert res.exit_code == 2 and "outside the artifact" in _one_error_line(res)
        (art / "cpu_experts").unlink()
        shutil.copytree(far, art / "cpu_experts")
        assert cli("verify", art).exit_code == 0
    finally:
        shutil.rmtree(far)


def test_a_rename_failing_with_exdev_at_the_move_changes_nothing(
    tiny_artifact: Path, tiny_artifact_1mb: Path, tmp_path: Path, monkeypatch
) -> None:
    """The check before the move, simulated: every rename into OUTPUT fails as across devices."""
    out, work = tmp_path / "out", tmp_path / "out" / PARTIAL
    shutil.copytree(tiny_artifact, out)
    shutil.copytree(tiny_artifact_1mb, work)  # a complete new artifact waiting to move in
    before = tree_hashes(out)
    real = os.rename

    def rename(src, dst) -> None:
        if Path(dst).parent == out:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), str(dst))
        real(src, dst)

    monkeypatch.setattr(move.os, "rename", rename)
    with pytest.raises(HetquantError, match="on another file system than OUTPUT"):
        move.move_in(out, work)
    monkeypatch.undo()
    assert tree_hashes(out) == before
    move.move_in(out, work)  # once renames work, the same move goes through
    assert _artifact_tree(out) == tree_hashes(tiny_artifact_1mb)


def test_an_interrupted_move_then_another_convert_leaves_no_file_of_either_behind(
    cli, tiny_ro: Path, artifact_copy: Path, tiny_hybrid: Path
) -> None:
    """The old artifact's and the interrupted one's files are hetquant's (``owned.json``): the
    third convert removes what it does not need, and still keeps the user's files."""
    _add_user_files(artifact_copy)
    args = ["convert", tiny_ro, artifact_copy, *BF16, "--max-shard-size", "1MB", "--overwrite"]
    proc = start_hetquant(args, setup=_KILL_AT_THIRD_RENAME)
    _, err = proc.communicate(timeout=300)  # a hang guard
    assert proc.returncode == 9, err
    assert not (artifact_copy / MANIFEST).exists()
    res = cli("convert", tiny_ro, artifact_copy, "--recipe", "ascend-hybrid", "--overwrite")
    assert res.exit_code == 0, res.stderr
    want = {**tree_hashes(tiny_hybrid), **{n: _sha(t) for n, t in USER.items()}}
    got = _artifact_tree(artifact_copy)
    assert got.keys() == want.keys()  # no shard of the bf16 artifacts left
    assert not (artifact_copy / PARTIAL).exists()


_KILL_AT_THIRD_RENAME = """
import os
from pathlib import Path
_real, _n = os.replace, []
def _replace(src, dst):
    if Path(src).parent.name == ".hetquant-partial" and Path(dst).parent.name != ".hetquant-partial":
        _n.append(dst)
        if len(_n) == 3:
            os._exit(9)
    _real(src, dst)
os.replace = _replace
"""


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def test_a_manifest_naming_files_outside_output_deletes_none_of_them(
    cli, tiny_ro: Path, artifact_copy: Path, tmp_path: Path
) -> None:
    """The old manifest is untrusted (a download): ``..`` or an absolute path in its ``files``
    is not the artifact's to remove."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours\n")
    manifest = read_json(artifact_copy / MANIFEST)
    manifest["files"]["../victim.txt"] = {"size": 10, "sha256": "0" * 64}
    manifest["files"][str(victim)] = {"size": 10, "sha256": "0" * 64}
    (artifact_copy / MANIFEST).write_text(json.dumps(manifest))
    res = cli("convert", tiny_ro, artifact_copy, *BF16, "--overwrite")
    assert res.exit_code == 0, res.stderr
    assert victim.read_text() == "not yours\n"
