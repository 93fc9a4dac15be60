"""What ``open_artifact`` / ``Artifact.load`` open (issue 25 §1, §2): root shards resolve inside the
artifact like the cpu_experts files (a link out of it is refused, not read), only regular files
are opened (a FIFO is refused, not waited on), errors show no bytes of a file, and a download in
the Hugging Face cache layout (links into ``blobs/``) loads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from support import INDEX, hf_cache_snapshot, no_hang, read_json

from hetquant.formats import HetquantError
from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.experts.expert_pool import CpuExpertPool

SECRET = b"TOPSECRET api key 0123456789\n"


@pytest.fixture
def art(tiny_artifact: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(tiny_artifact, dst)
    return dst


def _shard(art: Path) -> Path:
    return art / read_json(art / INDEX)["weight_map"]["lm_head.weight"]


def test_a_root_shard_linked_out_of_the_artifact_is_refused(art: Path, tmp_path: Path) -> None:
    """A valid shard outside (here: the same bytes) was read, and gave its logits; now the link is
    refused as the cpu_experts files' links are."""
    shard = _shard(art)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    os.symlink(outside, shard)
    with pytest.raises(HetquantError, match=rf"shard '{shard.name}' is a link to .*elsewhere"):
        open_artifact(art)


@pytest.mark.parametrize("target", ["link-to-text", "text"])
def test_a_shard_that_is_not_safetensors_shows_none_of_its_bytes(
    art: Path, tmp_path: Path, target: str
) -> None:
    shard = _shard(art)
    shard.unlink()
    if target == "text":
        shard.write_bytes(SECRET)
    else:  # a link out of the artifact: refused before a byte is read
        (tmp_path / "secret.txt").write_bytes(SECRET)
        os.symlink(tmp_path / "secret.txt", shard)
    with pytest.raises(HetquantError) as e:
        open_artifact(art)
    shown = str(e.value)
    assert shard.name in shown and "TOPSECRET" not in shown
    assert str(int.from_bytes(SECRET[:8], "little")) not in shown


def test_a_fifo_shard_is_refused_not_waited_on(art: Path) -> None:
    shard = _shard(art)
    opened = open_artifact(art)  # then the shard is swapped for a FIFO before the load
    shard.unlink()
    os.mkfifo(shard)
    with no_hang(), pytest.raises(HetquantError, match=r"is a FIFO \(named pipe\), not a regular"):
        opened.load(ParallelLayout())
    with no_hang(), pytest.raises(HetquantError, match=r"is a FIFO \(named pipe\), not a regular"):
        open_artifact(art)


def test_a_directory_shard_is_refused(art: Path) -> None:
    shard = _shard(art)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(IsADirectoryError, match="Is a directory"):
        open_artifact(art)


def test_a_hub_cache_download_loads(tiny_hybrid: Path, tmp_path: Path) -> None:
    """``snapshot_download`` leaves every file a link into the repo's ``blobs/``: the links are
    followed, the tensors and the CPU expert pool are those of the directory it came from."""
    snap = hf_cache_snapshot(tiny_hybrid, tmp_path / "hub")
    assert (snap / "cpu_experts").is_dir() and not (snap / "cpu_experts").is_symlink()
    cached, plain = open_artifact(snap), open_artifact(tiny_hybrid)
    got, want = cached.load(ParallelLayout()), plain.load(ParallelLayout())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [p.relative_to(snap) for p in cached.cpu_expert_files.values()] == [
        p.relative_to(tiny_hybrid) for p in plain.cpu_expert_files.values()
    ]
    pool = CpuExpertPool.open(snap)
    assert pool.layers == CpuExpertPool.open(tiny_hybrid).layers


def test_cpu_expert_files_named_out_of_the_artifact_are_refused(
    tiny_hybrid: Path, tmp_path: Path
) -> None:
    art = tmp_path / "art"
    shutil.copytree(tiny_hybrid, art)
    (tmp_path / "secret.txt").write_bytes(SECRET)
    layer = sorted((art / "cpu_experts").iterdir())[0]
    layer.unlink()
    os.symlink(tmp_path / "secret.txt", layer)
    with pytest.raises(HetquantError, match=r"cpu_experts file '.*' is a link to .*secret\.txt"):
        CpuExpertPool.open(art)
    with pytest.raises(HetquantError, match="outside the artifact"):
        open_artifact(art).cpu_expert_files  # noqa: B018  (the property checks the names)
