"""An untrusted config.json through the commands (issue #25 §3): absurd counts and wrong-typed
fields are one ``error: …`` line and exit 2 from ``convert --dry-run``, ``inspect`` and ``run`` —
fast, within a bounded address space, no traceback."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import HETQUANT_MAIN, REPO, error_line, read_json, write_json

AS_LIMIT = 1536 * 2**20  # a dry run of the tiny model fits; a per-name expansion of 10^6 does not
ABSURD = [
    ("deepseek", {"n_routed_experts": 10**6}, "1000000 routed experts"),
    ("deepseek", {"num_nextn_predict_layers": 10**6}, "1000003 decoder layers"),
    ("deepseek", {"num_hidden_layers": 10**5}, "100001 decoder layers"),
    ("qwen3", {"num_experts": 10**6}, "1000000 routed experts"),
    ("qwen3", {"num_hidden_layers": 10**5}, "100000 decoder layers"),
]
WRONG_TYPED = [  # (changes, what the line says: the field, what it must be, the value)
    ({"num_nextn_predict_layers": "abc"}, "num_nextn_predict_layers must be an integer", "'abc'"),
    ({"quantization_config": "fp8"}, "quantization_config must be a JSON object", "'fp8'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}},
     "quantization_config.weight_block_size must be a list of 2 integers", "got 128"),
    ({"num_experts_per_tok": "x"}, "num_experts_per_tok must be an integer", "got 'x'"),
    ({"n_routed_experts": -8}, "n_routed_experts must be an integer in [0, ", "got -8"),
    ({"hidden_size": 0}, "hidden_size must be an integer in [1, ", "got 0"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer", "got True"),
    ({"kv_lora_rank": 128.0}, "kv_lora_rank must be an integer", "got 128.0"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false", "got 'yes'"),
]  # fmt: skip


def _edited(src: Path, dst: Path, changes: dict) -> Path:
    shutil.copytree(src, dst)
    write_json(dst / "config.json", {**read_json(dst / "config.json"), **changes})
    return dst


def _bounded(*args: object) -> subprocess.CompletedProcess:
    """``hetquant ARGS`` in a child whose address space is capped at ``AS_LIMIT``."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    cmd = [sys.executable, "-c", HETQUANT_MAIN, *map(str, args)]
    return subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, preexec_fn=cap, timeout=300
    )


@pytest.mark.parametrize(("family", "changes", "needle"), ABSURD)
def test_absurd_counts_refused_before_expansion(
    family: str, changes: dict, needle: str, tiny_ro: Path, tiny_qwen3: dict, tmp_path: Path
) -> None:
    src = _edited(tiny_ro if family == "deepseek" else tiny_qwen3["fp8"], tmp_path / "s", changes)
    for args in (("convert", src, tmp_path / "out", "--recipe", "bf16", "--dry-run"),
                 ("inspect", src)):  # fmt: skip
        res = _bounded(*args)
        assert res.returncode == 2, (args, res.returncode, res.stderr[-2000:])
        line = error_line(res.stderr)
        assert needle in line and "config.json claims" in line and "index.json" in line, line


def test_control_dry_run_fits_the_address_space_cap(tiny_ro: Path, tmp_path: Path) -> None:
    res = _bounded("convert", tiny_ro, tmp_path / "out", "--recipe", "bf16", "--dry-run")
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize(("changes", "needle", "value"), WRONG_TYPED)
def test_wrong_typed_fields(
    changes: dict, needle: str, value: str, cli, tiny_ro: Path, tiny_artifact: Path, tmp_path: Path
) -> None:
    src = _edited(tiny_ro, tmp_path / "s", changes)
    art = _edited(tiny_artifact, tmp_path / "a", changes)
    runs = {
        "convert --dry-run": ("convert", src, tmp_path / "out", "--recipe", "bf16", "--dry-run"),
        "inspect": ("inspect", src),
        "run": ("run", art, "--tokens", "1,2,3"),
    }
    for what, args in runs.items():
        res = cli(*args)
        assert res.exception is None and res.exit_code == 2, (what, res.exception, res.stderr)
        line = error_line("\n".join(x for x in res.stderr.splitlines() if "INFO" not in x))
        assert all(n in line for n in ("config.json: field ", needle, value)), (what, line)


def test_an_artifacts_absurd_counts_are_refused_before_expansion(
    tiny_hybrid: Path, tmp_path: Path
) -> None:
    """The artifact side of the same attack: an artifact whose config.json claims 10^6 experts is
    refused by ``run`` (exit 2) and failed by ``verify`` (exit 1), both counting the claim
    against what the artifact stores before any name is expanded."""
    art = _edited(tiny_hybrid, tmp_path / "a", {"n_routed_experts": 10**6})
    res = _bounded("run", art, "--tokens", "1,2")
    assert res.returncode == 2, res.stderr[-2000:]
    line = error_line(res.stderr)
    assert "config.json implies 9,000,063 tensors" in line and "stores" in line, line
    res = _bounded("verify", art)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "implies 9,000,063 tensors, more than the artifact's files hold" in res.stdout
