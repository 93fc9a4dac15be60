"""Which file system holds a path (convert/fs/mounts.py), and the writer's choice it drives."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetquant.convert.engine.writer import PieceWriter
from hetquant.convert.fs.mounts import file_system_type, memory_backed

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:21 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
24 22 0:22 / /data rw shared:3 - xfs /dev/sdb1 rw
25 24 0:23 / /data/with\\040space rw shared:4 - tmpfs none rw
26 22 0:24 / /dev/shmx rw - ext4 /dev/sdc1 rw
garbage line without the separator
"""


@pytest.fixture
def info(tmp_path: Path) -> str:
    p = tmp_path / "mountinfo"
    p.write_text(MOUNTINFO)
    return str(p)


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/", "ext4"), ("/dev/shm/out", "tmpfs"), ("/dev/shm", "tmpfs"), ("/data/a/b", "xfs"),
     ("/data/with space/x", "tmpfs"), ("/dev/shmx/y", "ext4"), ("/home/u", "ext4")],
)  # fmt: skip
def test_the_longest_mount_point_prefix_names_the_type(info: str, path: str, kind: str) -> None:
    assert file_system_type(path, info) == kind


def test_unreadable_mountinfo_is_unknown(tmp_path: Path) -> None:
    assert file_system_type("/", str(tmp_path / "missing")) is None


@pytest.mark.skipif(not Path("/proc/self/mountinfo").exists(), reason="Linux only")
def test_the_writer_maps_on_memory_and_writes_on_disk(tmp_path: Path, monkeypatch) -> None:
    on_memory = memory_backed(tmp_path)
    assert PieceWriter([], tmp_path, mapped=True).mapped is on_memory
    assert PieceWriter([], tmp_path, mapped=False).mapped is False
    monkeypatch.setenv("HETQUANT_WRITE", "mmap")
    assert PieceWriter([], tmp_path, mapped=True).mapped is True
    monkeypatch.setenv("HETQUANT_WRITE", "pwrite")
    assert PieceWriter([], tmp_path, mapped=True).mapped is False
    if Path("/dev/shm").is_dir():
        assert memory_backed("/dev/shm")
