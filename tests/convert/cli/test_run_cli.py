"""``hetquant run`` and ``hetquant eval`` on bad input: every refusal one ``error:`` line (exit 2)
at any TP and before the compute; damaged weights that give non-finite logits fail (exit 1)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import INDEX, TINY, hf_cache_snapshot, no_hang, read_json, run_cli, st_header

from hetquant.calib.eval import eval_peak_bytes

TRAINED = TINY.parent / "tiny-deepseek-v3-trained"  # another model of the family
HELD = TINY.parent / "tiny-tools" / "heldout.txt"


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runcli")
    out = {}
    for recipe in ("bf16", "ascend-hybrid"):
        out[recipe] = base / recipe
        res = run_cli("convert", TINY, out[recipe], "--recipe", recipe)
        assert res.exit_code == 0, res.stderr
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _errors(res) -> list[str]:
    """stderr without the progress log."""
    return [line for line in res.stderr.splitlines() if not line.startswith("INFO ")]


def _one_error_line(res, *words: str) -> str:
    lines = _errors(res)
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(w in lines[0] for w in words), lines
    return lines[0]


def _set_lm_head(art: Path, value: bytes) -> None:
    """Overwrite the first 1,000 BF16 values of lm_head.weight with ``value`` (2 bytes)."""
    shard = art / read_json(art / INDEX)["weight_map"]["lm_head.weight"]
    start, header = st_header(shard)
    off = start + header["lm_head.weight"]["data_offsets"][0]
    with open(shard, "r+b") as f:
        f.seek(off)
        f.write(value * 1000)


# ----------------------------------------------------------------------------------------------
# run


@pytest.mark.parametrize("damage", ["missing", "truncated"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_bad_cpu_experts_file_is_one_line_at_any_tp(
    cli, arts, tmp_path: Path, damage: str, tp: int
) -> None:
    art = _copy(arts["ascend-hybrid"], tmp_path)
    layer = art / "cpu_experts" / "layer_002.safetensors"
    if damage == "missing":
        layer.unlink()
    else:
        layer.write_bytes(layer.read_bytes()[:1000])
    res = cli("run", art, "--tokens", "5,17", "--tp", tp)
    _one_error_line(res, "layer_002.safetensors", damage if damage == "missing" else "truncated")
    assert "starting" not in res.stderr  # refused before any rank was spawned


# paths and files an artifact gives (issue 25 §1, §2) -------------------------------------------
def _root_shard(art: Path) -> Path:
    return art / read_json(art / INDEX)["weight_map"]["lm_head.weight"]


@pytest.mark.parametrize("swap", ["link-out", "fifo"])
def test_run_refuses_a_root_shard_out_of_the_artifact_or_not_a_file(
    cli, arts, tmp_path: Path, swap: str
) -> None:
    """A shard linked to a file outside ran (exit 0, that file's logits); a FIFO hung forever."""
    art = _copy(arts["ascend-hybrid"], tmp_path)
    shard = _root_shard(art)
    if swap == "link-out":
        shutil.move(shard, tmp_path / "elsewhere.safetensors")
        os.symlink(tmp_path / "elsewhere.safetensors", shard)
    else:
        shard.unlink()
        os.mkfifo(shard)
    with no_hang():
        res = cli("run", art, "--tokens", "5,17")
    words = ("outside the artifact",) if swap == "link-out" else ("is a FIFO", "not a regular")
    _one_error_line(res, shard.name, *words)


def test_run_loads_a_hybrid_from_the_hub_cache(cli, arts, tmp_path: Path) -> None:
    """A hybrid downloaded the normal way (every file a link into ``blobs/``) was refused
    ("points outside the artifact"); it runs, with the logits of the directory it came from."""
    snap = hf_cache_snapshot(arts["ascend-hybrid"], tmp_path / "hub")
    got = cli("run", snap, "--tokens", "5,17", "--save-logits", tmp_path / "hub.npy")
    want = cli(
        "run", arts["ascend-hybrid"], "--tokens", "5,17", "--save-logits", tmp_path / "a.npy"
    )
    assert got.exit_code == 0 and want.exit_code == 0, (got.stderr, want.stderr)
    assert got.stdout == want.stdout
    assert np.array_equal(np.load(tmp_path / "hub.npy"), np.load(tmp_path / "a.npy"))


def test_a_rank_error_comes_back_as_its_one_line(
    cli, arts, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    art = _copy(arts["bf16"], tmp_path)
    _set_lm_head(art, b"\xc0\x7f")  # BF16 NaN: only the ranks' weight checks read values
    single = _one_error_line(cli("run", art, "--tokens", "5,17"))
    capfd.readouterr()
    res = cli("run", art, "--tokens", "5,17", "--tp", 2)
    assert _one_error_line(res) == single  # the rank's own message, as at --tp 1
    assert "Traceback" not in res.stderr + capfd.readouterr().err  # nor from the children


def test_non_finite_logits_fail_and_point_to_verify(cli, arts, tmp_path: Path) -> None:
    art = _copy(arts["bf16"], tmp_path)
    _set_lm_head(art, b"\x70\x7f")  # finite (≈ 3e38) weights whose logits overflow
    res = cli("run", art, "--tokens", "5,17", "--save-logits", tmp_path / "l.npy")
    assert res.exit_code == 1, res.stderr
    assert not np.isfinite(np.load(tmp_path / "l.npy")).all()  # saved all the same, for a look
    fail = res.stdout.splitlines()[-1]
    assert fail.startswith("FAIL ") and "NaN or Inf" in fail
    assert fail.endswith(f"run `hetquant verify {art}`")


@pytest.mark.parametrize("tokens", ["-1,5", "5,640", "5,100000"])
@pytest.mark.parametrize("tp", [1, 2])
def test_token_ids_outside_the_vocab(cli, arts, tokens: str, tp: int) -> None:
    res = cli("run", arts["bf16"], f"--tokens={tokens}", "--tp", tp)
    _one_error_line(res, "token ids must lie in [0, 640)")


def test_run_shows_progress(cli, arts, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exact-name"  # written as named (np.save alone would add .npy)
    res = cli("run", arts["ascend-hybrid"], "--tokens", "5,17", "--tp", 2, "--save-logits", out)
    assert res.exit_code == 0, res.stderr
    assert np.load(out).shape == (2, 640)
    log = res.stderr + capfd.readouterr().err  # the ranks log from their own processes
    for line in [
        f"INFO hetquant.run: checked {arts['ascend-hybrid']}: 1 root shard(s), 3 cpu_experts file(s)",
        "INFO hetquant.run: starting 2 rank(s) (tp=2 pp=1 ep=1, gloo) on this host",
        "INFO hetquant.run: running 2 tokens",
    ]:
        assert line in log.splitlines(), (line, log)
    for rank in (0, 1):
        assert f"INFO hetquant.run: rank {rank} of 2: loaded " in log


@pytest.mark.parametrize("option", ["--save-logits", "--json"])
def test_outputs_are_checked_before_the_compute(
    cli, arts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str
) -> None:
    from hetquant.calib import eval as calib_eval
    from hetquant.runtime.serving import run as runtime_run

    def never(*a: object, **k: object) -> None:
        raise AssertionError("computed before checking the output path")

    monkeypatch.setattr(runtime_run, "run_artifact", never)
    monkeypatch.setattr(calib_eval, "evaluate", never)
    base = (
        ["run", arts["bf16"], "--tokens", "5"]
        if option == "--save-logits"
        else ["eval", arts["bf16"], "--reference", TINY, "--text", HELD]
    )
    missing = tmp_path / "no" / "such" / "out.json"
    _one_error_line(
        cli(*base, option, missing), option, f"directory {missing.parent} does not exist"
    )
    _one_error_line(cli(*base, option, tmp_path), option, "is a directory")


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_failed_write_is_one_line(cli, arts, command: str) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here to make a write fail")
    args = (
        ["run", arts["bf16"], "--tokens", "5", "--save-logits", "/dev/full"]
        if command == "run"
        else ["eval", arts["bf16"], "--reference", TINY, "--text", HELD, "--samples", 1,
              "--seq-len", 16, "--json", "/dev/full"]
    )  # fmt: skip
    _one_error_line(cli(*args), "/dev/full: cannot write: No space left on device")


def test_prompt_is_its_tokens_through_the_artifacts_tokenizer(cli, arts) -> None:
    """``--prompt TEXT``: the ids the artifact's tokenizer.json gives (BOS included, as
    transformers' tokenizer for the model gives them), the generated ids decoded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(arts["bf16"] / "tokenizer.json"))
    ids = tok.encode("The cat sat").ids
    assert ids[0] == 0  # <｜begin▁of▁sentence｜>
    by_text = cli("run", arts["bf16"], "--prompt", "The cat sat", "--generate", "4")
    by_ids = cli("run", arts["bf16"], "--tokens", ",".join(map(str, ids)), "--generate", "4")
    assert by_text.exit_code == 0 and by_ids.exit_code == 0, by_text.stderr
    lines = by_text.stdout.splitlines()
    assert lines[:2] == by_ids.stdout.splitlines()  # the ran ... and generated: lines
    generated = [int(t) for t in lines[1].removeprefix("generated: ").split(",")]
    assert len(generated) == 4
    assert lines[2] == f"text: {tok.decode(generated, skip_special_tokens=True)}"
    default = cli("run", arts["bf16"], "--prompt", "The cat sat")
    assert len(default.stdout.splitlines()[1].split(",")) == 16  # --generate 16 by default


def test_prompt_or_tokens_and_a_tokenizer_to_read(cli, arts, tmp_path: Path) -> None:
    for args in ([], ["--tokens", "5", "--prompt", "hi"]):
        _one_error_line(cli("run", arts["bf16"], *args), "--tokens", "--prompt")
    art = _copy(arts["bf16"], tmp_path)
    (art / "tokenizer.json").unlink()
    _one_error_line(cli("run", art, "--prompt", "hi"), "no tokenizer.json", "--tokens")


# ----------------------------------------------------------------------------------------------
# eval


def test_eval_seq_len_beyond_the_model_is_refused(cli, arts) -> None:
    res = cli("eval", arts["bf16"], "--reference", TINY, "--text", HELD, "--seq-len", 100000)
    _one_error_line(res, "--seq-len 100000", "max_position_embeddings 4096", "4096 or less")


def test_eval_seq_len_beyond_the_memory_is_refused(
    cli, arts, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    cli_module = importlib.import_module("hetquant.convert.cli.run")  # the package's ``run`` is
    # the click command

    cfg = read_json(arts["bf16"] / "config.json")
    avail = eval_peak_bytes(cfg, 8, 1000)  # 1,000 tokens fit exactly, 1,001 do not
    monkeypatch.setattr(cli_module, "available_memory", lambda: avail)
    res = cli("eval", arts["bf16"], "--reference", TINY, "--text", HELD, "--seq-len", 4000)
    _one_error_line(res, "--samples 8 x --seq-len 4000", "GB of memory", "--seq-len 1000 or less")


def test_eval_peak_grows_with_the_quadratic_attention() -> None:
    cfg = read_json(TINY / "config.json")
    h, v = cfg["num_attention_heads"], cfg["vocab_size"]
    assert eval_peak_bytes(cfg, 8, 100000) >= 4 * 100000**2 * (1 + 3 * h)  # the 40 GB mask + H·T²
    assert eval_peak_bytes(cfg, 2, 512) - eval_peak_bytes(cfg, 1, 512) == 12 * 512 * v


def test_eval_refuses_another_model_as_reference(cli, arts) -> None:
    res = cli("eval", arts["bf16"], "--reference", TRAINED, "--text", HELD)
    line = _one_error_line(res, f"--reference {TRAINED} is not the checkpoint", "config.json")
    assert "hidden_size (256 vs 384)" in line and "token ids" not in line


def test_eval_same_config_other_index_warns_and_runs(cli, arts, tmp_path: Path) -> None:
    ref = _copy(TINY, tmp_path)
    index = read_json(ref / INDEX)
    (ref / INDEX).write_text(json.dumps(index))  # same map, other bytes: another fingerprint
    json_out = tmp_path / "e.json"
    args = ["--text", HELD, "--samples", 1, "--seq-len", 16, "--json", json_out]
    res = cli("eval", arts["bf16"], "--reference", ref, *args)
    assert res.exit_code == 0, res.stderr
    assert _errors(res) == [
        f"warning: --reference {ref} has the config of {arts['bf16']}'s source but another "
        "index (fingerprint differs): its weights may differ from those converted"
    ]
    assert read_json(json_out)["kl"] == 0.0  # the bf16 artifact is its source, exactly
    same = cli("eval", arts["bf16"], "--reference", TINY, *args)
    assert same.exit_code == 0 and _errors(same) == []


def test_a_kv_cache_the_family_does_not_emulate_is_one_line(cli, arts) -> None:
    res = cli("run", arts["bf16"], "--tokens", "5,17", "--kv-cache", "fp8_ds_mla")
    assert res.exit_code == 2
    assert _errors(res) == [
        "error: --kv-cache fp8_ds_mla: the deepseek_v3 forward emulates no KV cache; leave it out"
    ]
