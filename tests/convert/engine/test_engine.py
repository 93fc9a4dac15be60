"""The conversion engine on the tiny model, recipe bf16: exactness, determinism, sharding, resume."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from support import (
    INDEX,
    MANIFEST,
    PARTIAL,
    blake3_hex,
    journal_jobs,
    read_json,
    ref_dequant_bits,
    resave_shard,
    sha256,
    shard_of,
    st_bytes,
    st_header,
    tiny_counts,
    tree_hashes,
    wait_for_jobs,
)

from hetquant.convert.engine import finalize, jobs

SCALE = "_scale_inv"
AUX = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _tensors(root: Path) -> dict[str, tuple[Path, dict]]:
    """Tensor name → (shard, header entry) for every shard of a checkpoint directory."""
    out: dict[str, tuple[Path, dict]] = {}
    for f in sorted(root.glob("*.safetensors")):
        _, header = st_header(f)
        for name, entry in header.items():
            if name != "__metadata__":
                assert name not in out, f"{name} in two shards"
                out[name] = (f, entry)
    return out


def _shards(root: Path) -> list[Path]:
    return sorted(root.glob("model-*.safetensors"))


# ----------------------------------------------------------------------------------------------
# the artifact's content


def test_bf16_tensors_follow_the_formula_and_copies_are_byte_identical(
    tiny_ro: Path,
    tiny_artifact: Path,
) -> None:
    src, out = _tensors(tiny_ro), _tensors(tiny_artifact)
    assert set(out) == {n for n in src if not n.endswith(SCALE)}
    assert not [n for n in out if n.endswith(SCALE)]
    n_fp8 = 0
    for name, (file, entry) in out.items():
        sfile, sentry = src[name]
        assert entry["shape"] == sentry["shape"], name
        if sentry["dtype"] == "F8_E4M3":
            n_fp8 += 1
            assert entry["dtype"] == "BF16", name
            codes = np.frombuffer(st_bytes(sfile, name), dtype=np.uint8).reshape(sentry["shape"])
            scale_file, scale_entry = src[name + SCALE]
            scale = np.frombuffer(st_bytes(scale_file, name + SCALE), dtype=np.float32)
            want = ref_dequant_bits(codes, scale.reshape(scale_entry["shape"]))
            got = np.frombuffer(st_bytes(file, name), dtype=np.uint16).reshape(entry["shape"])
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert entry["dtype"] == sentry["dtype"], name
            assert st_bytes(file, name) == st_bytes(sfile, name), name
    assert n_fp8 > 50


def test_artifact_files_index_config_and_aux(tiny_ro: Path, tiny_artifact: Path) -> None:
    src_config = read_json(tiny_ro / "config.json")
    config = read_json(tiny_artifact / "config.json")
    assert "quantization_config" not in config
    assert config == {k: v for k, v in src_config.items() if k != "quantization_config"}
    for name in AUX:
        assert sha256(tiny_artifact / name) == sha256(tiny_ro / name), name

    index = read_json(tiny_artifact / INDEX)
    shards = _shards(tiny_artifact)
    assert [s.name for s in shards] == ["model-00001-of-00001.safetensors"]
    holder = {n: f.name for n, (f, _) in _tensors(tiny_artifact).items()}
    assert index["weight_map"] == holder
    data_bytes = sum(s.stat().st_size - st_header(s)[0] for s in shards)
    entries = _tensors(tiny_artifact).values()
    assert index["metadata"]["total_size"] == data_bytes
    assert data_bytes == sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e in entries)

    # the safetensors library reads every output tensor (validating the whole layout)
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert f.get_tensor(k).dtype in (torch.bfloat16, torch.float32)

    on_disk = {str(p.relative_to(tiny_artifact)) for p in tiny_artifact.rglob("*")}
    assert on_disk == {s.name for s in shards} | {INDEX, "config.json", MANIFEST, *AUX}
    manifest = read_json(tiny_artifact / MANIFEST)
    assert manifest["complete"] is True
    assert (manifest["schema_version"], manifest["file_digest"]) == (3, "blake3")
    assert manifest["recipe"] == {"name": "bf16", "options": {}}
    assert set(manifest["files"]) == on_disk - {MANIFEST}
    for name, want in manifest["files"].items():
        path = tiny_artifact / name
        assert want == {"size": path.stat().st_size, "blake3": blake3_hex(path)}, name
    assert manifest["source"]["path"] == str(tiny_ro)


# ----------------------------------------------------------------------------------------------
# determinism


def test_two_runs_are_byte_identical(
    tiny_ro: Path, cli, tiny_artifact: Path, tmp_path: Path
) -> None:
    """Every file, the manifest included: it holds no time, host or OUTPUT path; its only
    run-dependent field, the source path, is the same here."""
    res = cli("convert", tiny_ro, tmp_path / "again", "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(tmp_path / "again") == tree_hashes(tiny_artifact)


def test_workers_2_is_byte_identical_to_workers_1(
    tiny_ro: Path, cli, tiny_artifact: Path, tmp_path: Path
) -> None:
    res = cli("convert", tiny_ro, tmp_path / "w2", "--recipe", "bf16", "--workers", "2")
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(tmp_path / "w2") == tree_hashes(tiny_artifact)


def test_source_path_is_the_only_manifest_difference_between_sources(
    cli, tiny_artifact: Path, tiny_src: Path, tmp_path: Path
) -> None:
    res = cli("convert", tiny_src, tmp_path / "o", "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    a, b = tree_hashes(tiny_artifact), tree_hashes(tmp_path / "o")
    assert {k for k in a if a[k] != b.get(k)} == {MANIFEST}
    ma, mb = read_json(tiny_artifact / MANIFEST), read_json(tmp_path / "o" / MANIFEST)
    assert mb["source"].pop("path") == str(tiny_src)
    ma["source"].pop("path")
    assert ma == mb


# ----------------------------------------------------------------------------------------------
# sharding


def test_small_max_shard_size_splits_with_identical_content(
    tiny_artifact: Path, tiny_artifact_1mb: Path
) -> None:
    shards = _shards(tiny_artifact_1mb)
    n = len(shards)
    assert n > 3
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]  # fmt: skip
    one, many = _tensors(tiny_artifact), _tensors(tiny_artifact_1mb)
    assert one.keys() == many.keys()
    for name, (f, e) in many.items():
        assert e["dtype"] == one[name][1]["dtype"] and e["shape"] == one[name][1]["shape"]
        assert st_bytes(f, name) == st_bytes(one[name][0], name), name
    # same tensor order, cut into consecutive shards of at most 1 MB of data each
    order = []
    for s in shards:
        start, header = st_header(s)
        header.pop("__metadata__")
        assert s.stat().st_size - start <= 1_000_000, s.name
        order += sorted(header, key=lambda k: header[k]["data_offsets"][0])
    _, h1 = st_header(_shards(tiny_artifact)[0])
    h1.pop("__metadata__")
    assert order == sorted(h1, key=lambda k: h1[k]["data_offsets"][0])
    index = read_json(tiny_artifact_1mb / INDEX)
    assert index["weight_map"] == {k: f.name for k, (f, _) in many.items()}
    assert index["metadata"] == read_json(tiny_artifact / INDEX)["metadata"]
    for name in ("config.json", *AUX):
        assert sha256(tiny_artifact_1mb / name) == sha256(tiny_artifact / name)


# ----------------------------------------------------------------------------------------------
# interruption and resume


def _assert_incomplete(out: Path) -> None:
    assert not (out / MANIFEST).exists()
    assert {p.name for p in out.iterdir()} == {PARTIAL}


def test_sigkill_then_rerun_resumes_byte_identically(
    tiny_ro: Path, cli, hetquant_proc, tiny_artifact_1mb: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, "--recipe", "bf16", "--max-shard-size", "1MB"]
    proc = hetquant_proc(args, slow_jobs=0.2)
    wait_for_jobs(proc, out, 5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = journal_jobs(out)
    assert 5 <= len(done) < tiny_counts(tiny_ro)[0]
    _assert_incomplete(out)  # an interrupted run never looks complete
    res = cli("verify", out)
    assert res.exit_code == 2 and res.stderr.startswith("error: ")

    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert f"{len(done)} already done" in res.stderr  # it resumed rather than started over
    assert tree_hashes(out) == tree_hashes(tiny_artifact_1mb)
    assert cli("verify", out).exit_code == 0


class Interrupt(BaseException):
    """Stands for Ctrl-C / a crash: not an Exception, so nothing on the way catches it."""


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    real, calls = jobs.JobRunner.run, []

    def run(self, job):
        if len(calls) == n:
            raise Interrupt
        calls.append(job.id)
        return real(self, job)

    monkeypatch.setattr(jobs.JobRunner, "run", run)


def test_interrupted_run_refuses_other_options_and_resumes(
    tiny_ro: Path, cli, tiny_artifact: Path, tiny_artifact_1mb: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, "--recipe", "bf16"]
    _interrupt_after(monkeypatch, 40)
    with pytest.raises(Interrupt):
        cli(*args)
    monkeypatch.undo()
    assert len(journal_jobs(out)) == 40
    _assert_incomplete(out)

    # other options than the interrupted run: refused, nothing touched
    before = tree_hashes(out)
    res = cli(*args, "--max-shard-size", "1MB")
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and "interrupted convert" in res.stderr
    assert tree_hashes(out) == before

    # the same command resumes and finishes with the uninterrupted bytes
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert "40 already done" in res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact)

    # --overwrite over an interrupted run with other options starts over
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(Interrupt):
        cli("convert", tiny_ro, tmp_path / "o2", "--recipe", "bf16")
    monkeypatch.undo()
    res = cli("convert", tiny_ro, tmp_path / "o2", "--recipe", "bf16", "--max-shard-size", "1MB", "--overwrite")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(tmp_path / "o2") == tree_hashes(tiny_artifact_1mb)


def test_resume_rewrites_damaged_work_files(
    tiny_ro: Path, cli, tiny_artifact_1mb: Path, tmp_path: Path, monkeypatch
) -> None:
    """A work file whose header no longer matches (here: truncated) is rebuilt and its jobs redone,
    even though the journal lists them."""
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, "--recipe", "bf16", "--max-shard-size", "1MB"]
    _interrupt_after(monkeypatch, 60)
    with pytest.raises(Interrupt):
        cli(*args)
    monkeypatch.undo()
    work = sorted((out / PARTIAL).glob("model-*.safetensors"))
    with work[0].open("r+b") as f:
        f.truncate(100)
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact_1mb)


def test_interrupted_finalization_never_leaves_a_manifest_and_resumes(
    tiny_ro: Path, cli, tiny_artifact: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "out"
    args = ["convert", tiny_ro, out, "--recipe", "bf16"]
    real = finalize.write_json_atomic

    def write_json_atomic(path: Path, doc) -> None:
        if path.name == MANIFEST:
            raise Interrupt
        real(path, doc)

    monkeypatch.setattr(finalize, "write_json_atomic", write_json_atomic)
    with pytest.raises(Interrupt):
        cli(*args)
    monkeypatch.undo()
    assert not (out / MANIFEST).exists()
    assert (out / PARTIAL).is_dir()  # the resume state survives until the manifest is written
    assert cli("verify", out).exit_code == 2  # not an artifact
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert tree_hashes(out) == tree_hashes(tiny_artifact)


def test_failed_run_leaves_nothing_that_looks_complete(cli, tiny_src: Path, tmp_path: Path) -> None:
    """A failure in the middle of the jobs (bad data found late) leaves only the work dir."""
    name = "model.layers.2.mlp.experts.3.up_proj.weight"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name].view(torch.uint8)[7, 9] = 0x7F

    resave_shard(shard_of(tiny_src, name), poison)
    out = tmp_path / "out"
    res = cli("convert", tiny_src, out, "--recipe", "bf16")
    assert res.exit_code == 2
    assert len(journal_jobs(out)) > 50  # it got far before meeting the bad tensor
    _assert_incomplete(out)


def test_source_is_never_written(
    tiny_ro_hashes: dict[str, str], tiny_ro: Path, tiny_artifact: Path, tiny_artifact_1mb: Path
) -> None:
    """Last in this file: after every conversion above, the session source hashes as before."""
    assert tree_hashes(tiny_ro) == tiny_ro_hashes


class _Calibrated:
    """What ``calibration_record`` reads of a CalibrationResult."""

    def __init__(self, **options: object) -> None:
        from hetquant.calib import AwqOptions

        self.options = AwqOptions(**options)
        self.stats = {"tokens": 64, "device": "cpu", "dtype": "float64"}
        self.quantized = ["model.layers.1.mlp.experts.0.up_proj.weight"]

    def quantizer(self, name: str) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(fmt=SimpleNamespace(name="awq_w4a16"))


@pytest.mark.parametrize(
    ("options", "present", "absent"),
    [({}, set(), {"gptq", "gptq_damp", "gptq_act_order", "gptq_sequential", "act_aware"}),
     ({"gptq": True}, {"gptq", "gptq_damp", "gptq_act_order", "gptq_sequential"}, {"act_aware"}),
     ({"act_aware": True}, {"act_aware"}, {"gptq", "gptq_damp"})],
)  # fmt: skip
def test_calibration_record_says_what_ran(options: dict, present: set, absent: set) -> None:
    """The manifest records a step's settings only where it ran: manifests made before GPTQ and
    the W8A8-aware search existed (and their golden bytes) are unchanged."""
    from hetquant.convert import calibration_record

    recorded = calibration_record(_Calibrated(**options))["options"]
    assert present <= recorded.keys() and not absent & recorded.keys()
    assert recorded["grid"] == 20 and recorded.get("gptq", True)  # the rest as before


@pytest.mark.parametrize(
    ("device", "dtype", "same"),
    [("cpu", "float64", True), ("cpu", "float32", False), ("cuda:0", "bfloat16", False)],
)
def test_calibration_record_says_where_it_ran(device: str, dtype: str, same: bool) -> None:
    """``calibration.compute``: only the CPU in float64 gives the same bytes on every CPU
    (calib/awq.py, "Reproducibility")."""
    from hetquant.convert import calibration_record

    cal = _Calibrated()
    cal.stats = {**cal.stats, "device": device, "dtype": dtype}
    compute = calibration_record(cal)["compute"]
    assert compute == {
        "device": device.split(":")[0],
        "dtype": dtype,
        "same_bytes_on_every_cpu": same,
    }
