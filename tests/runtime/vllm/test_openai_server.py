"""vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the wheel's ``vllm``
command fails with ``PackageNotFoundError``) serves the trained tiny DeepSeek-V3's ascend-hybrid
through the plugin, prefix caching on, on 127.0.0.1 at a free port: one chat completion (the
example tokenizer ships a chat template: DeepSeek-R1's ``<｜User｜>`` / ``<｜Assistant｜>``), asked
twice (the second hits the prefix cache), whose tokens equal ``hetquant run``'s on the prompt ids
the server rendered. Every wait is bounded; the server's whole process group is gone after.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import REPO, run_cli

from hetquant.runtime.serving.run import RunSpec, run_artifact

TRAINED = REPO / "examples" / "tiny-deepseek-v3-trained"
START_S = 600  # engine start on a loaded 2-core machine: ~30-90 s
STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text else {}


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            _request(f"{base}/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    pytest.fail(f"the server was not healthy within {START_S} s: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> list[int]:
    """SIGTERM to the server's process group (API server, engine core), SIGKILL after
    ``grace_s``; returns the pids still there after the grace."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return []
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (left := _group(pgid)):
        time.sleep(0.5)
    left = _group(pgid)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=grace_s)
    return left


def _group(pgid: int) -> list[int]:
    ps = subprocess.run(["ps", "-eo", "pgid=,pid=,stat="], capture_output=True, text=True).stdout
    rows = [line.split() for line in ps.splitlines()]
    return [int(r[1]) for r in rows if len(r) == 3 and int(r[0]) == pgid and "Z" not in r[2]]


def test_openai_server_chat_completion_of_the_hybrid(vllm_python: Path, tmp_path: Path) -> None:
    art = tmp_path / "hybrid"
    res = run_cli("convert", TRAINED, art, "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    port, log = _free_port(), tmp_path / "server.log"
    env = {**os.environ, "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [
        str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(art),
        "--quantization", "hetquant", "--load-format", "hetquant", "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "256", "--gpu-memory-utilization", "0.1",
        "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log)
        body = {
            "model": str(art),
            "messages": [{"role": "user", "content": "The cat sat on the"}],
            "max_tokens": STEPS, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        first = _request(f"{base}/v1/chat/completions", body)
        again = _request(f"{base}/v1/chat/completions", body)  # the prompt's blocks are cached
    finally:
        left = _stop(proc)
    assert not left, f"the server left processes behind: {left}"
    choice = first["choices"][0]
    assert isinstance(choice["message"]["content"], str) and first["usage"]["completion_tokens"]
    prompt_ids = first["prompt_token_ids"]
    assert prompt_ids[0] == 0 and len(prompt_ids) == first["usage"]["prompt_tokens"]
    _, want = run_artifact(RunSpec(str(art), tuple(prompt_ids), generate=STEPS))
    assert choice["token_ids"] == want
    assert again["choices"][0]["token_ids"] == want
