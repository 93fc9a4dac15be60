"""Shared test helpers (imported by name as ``support``) and the fixtures ``conftest.py`` exports.

- ``tiny_src``: a private copy of ``examples/tiny-deepseek-v3`` that a test may corrupt.
- ``cli``: runs ``hetquant`` in-process with click's CliRunner, stdout and stderr apart, with the
  root logger set up exactly as the real command sets it up (so log lines land on stderr as they
  would in a terminal).
- ``hetquant_proc``: starts ``hetquant.convert.cli:main`` (what the ``hetquant`` script runs) in a
  subprocess (its own process group), for signals and for end-to-end checks of stderr;
  ``slow_jobs`` wraps ``JobRunner.run`` with a sleep inside that child and its workers only
  (``tests/child_hooks``), so the tiny model can be killed mid-run. ``process_group``,
  ``journal_jobs``, ``wait_for_jobs`` watch such a child; ``tmpfs`` mounts a small or read-only
  file system (or skips, saying why).
- ``tiny_ro``: one session-wide copy of the example, the source of ``tiny_artifact`` /
  ``tiny_artifact_1mb`` (the bf16 artifact, default and 1 MB shards, converted once per session)
  and of every run compared with them. All three are read-only: copy before corrupting.
- ``hf_cache_snapshot``: a tree laid out as the Hugging Face cache keeps a download (links into
  ``blobs/``); ``no_hang``: a block that blocks fails instead (a FIFO opened for reading).
- Independent readers and editors of safetensors files and JSON (``st_header``, ``st_bytes``,
  ``resave_shard``, ``rewrite_header``, ...) that do not go through ``hetquant.formats``.
- ``ref_dequant_bits``: DeepSeek's FP8 block dequantization written out in numpy with integer
  bit manipulation, independent of torch's float8 / bfloat16 conversions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import runpy
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from hetquant.convert.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-deepseek-v3"
TOOLS = REPO / "examples" / "tiny-tools"  # its generator, training scripts and texts
INDEX = "model.safetensors.index.json"
MANIFEST = "hetquant.json"
PARTIAL = ".hetquant-partial"


# --------------------------------------------------------------------------------------------
# files and trees


# The cross-ISA tests (aarch64 under qemu user mode, x86 paths on SIMDe): their tools, which
# ``.ci/run`` installs; it sets HETQUANT_REQUIRE_CROSS=1, under which a missing one fails the test.
CROSS = "aarch64-linux-gnu-g++"
QEMUS = ("qemu-aarch64", "qemu-aarch64-static")


def missing_cross_tool(msg: str) -> None:
    """Skip the test for a missing cross-ISA tool, or fail it under HETQUANT_REQUIRE_CROSS=1."""
    msg += "; .ci/run installs it"
    if os.environ.get("HETQUANT_REQUIRE_CROSS") == "1":
        pytest.fail(msg + " (HETQUANT_REQUIRE_CROSS=1: this test must run)")
    pytest.skip(msg)


def aarch64_tools() -> tuple[str, str]:
    """(cross g++, qemu-aarch64): the tools that build and run aarch64 programs here."""
    cxx = shutil.which(CROSS)
    qemu = next((q for q in map(shutil.which, QEMUS) if q), None)
    if cxx is None or qemu is None:
        missing_cross_tool(
            f"needs {CROSS} and qemu-aarch64 (Debian: g++-aarch64-linux-gnu, qemu-user)"
        )
    return str(cxx), str(qemu)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def as_older_schema(doc: dict[str, Any], root: Path, version: int) -> dict[str, Any]:
    """Manifest ``doc`` of the artifact in ``root`` as hetquant wrote it under schema ``version``
    (1 or 2): no ``file_digest``, every file's digest a sha256 (schema 1: no ``module_formats``)."""
    doc = {k: v for k, v in doc.items() if k != "file_digest" and (version > 1 or k != "module_formats")}  # fmt: skip
    doc["schema_version"] = version
    doc["files"] = {n: {"size": f["size"], "sha256": sha256(root / n)} for n, f in doc["files"].items()}  # fmt: skip
    return doc


def blake3_hex(path: Path) -> str:
    """The BLAKE3 of a file in one call: what a schema-3 manifest records for it."""
    import blake3

    return blake3.blake3(path.read_bytes()).hexdigest()


def tree_hashes(root: Path) -> dict[str, str]:
    """Relative path → sha256 of every file under ``root`` (hidden ones included)."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def hf_cache_snapshot(tree: Path, cache: Path, repo: str = "org/name") -> Path:
    """``tree`` laid out as ``huggingface_hub.snapshot_download`` leaves a repo in its cache:
    every file in ``models--org--name/blobs/<sha256>``, and ``snapshots/<rev>/<path>`` a relative
    link to it (``../../blobs/<sha>``, one ``..`` more per sub-directory). Returns the snapshot."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / ("0123abcd" * 5)
    blobs.mkdir(parents=True)
    for src in sorted(p for p in tree.rglob("*") if p.is_file()):
        rel = src.relative_to(tree)
        digest = sha256(src)
        if not (blobs / digest).exists():
            shutil.copyfile(src, blobs / digest)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(Path(*[".."] * (len(rel.parts) + 1), "blobs", digest), link)
    return snap


@contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging when the block blocks for ``seconds`` (SIGALRM:
    the main thread only; a blocked ``open`` of a FIFO is interrupted)."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def drop_listed_file(art: Path, rel: str) -> None:
    """An artifact's file deleted, and dropped from its manifest too (parts and files): what
    verify cannot see from the manifest alone (issue #25 §2)."""
    (art / rel).unlink()
    doc = read_json(art / MANIFEST)
    for part in doc["parts"].values():
        if rel in part["files"]:
            part["files"].remove(rel)
    del doc["files"][rel]
    write_json(art / MANIFEST, doc)


def tiny_counts(src: Path) -> tuple[int, int]:
    """(source tensors that are not scales = jobs of the bf16 recipe, source shards)."""
    wm = read_json(src / INDEX)["weight_map"]
    return sum(not n.endswith("_scale_inv") for n in wm), len(set(wm.values()))


# --------------------------------------------------------------------------------------------
# safetensors, read and edited without hetquant.formats


def st_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header dict incl. ``__metadata__``) parsed by hand from the file."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def st_bytes(path: Path, name: str) -> bytes:
    """The raw data bytes of tensor ``name`` in ``path``."""
    start, header = st_header(path)
    begin, end = header[name]["data_offsets"]
    with path.open("rb") as f:
        f.seek(start + begin)
        return f.read(end - begin)


def shard_of(src: Path, tensor: str) -> Path:
    return src / read_json(src / INDEX)["weight_map"][tensor]


def resave_shard(path: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load every tensor of a shard, let ``mutate`` edit the dict in place, save it back."""
    tensors = {k: v.clone() for k, v in load_file(str(path)).items()}
    mutate(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Edit a shard's header JSON in place, keeping its length (space padded): data untouched."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    mutate(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= n, "edited header is longer than the original"
    with path.open("r+b") as f:
        f.seek(8)
        f.write(body + b" " * (n - len(body)))


def edit_index(src: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    doc = read_json(src / INDEX)
    mutate(doc)
    write_json(src / INDEX, doc)


# --------------------------------------------------------------------------------------------
# DeepSeek's FP8 block dequantization, independently: numpy float32 and integer rounding


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 E4M3FN codes: S.EEEE.MMM, bias 7, subnormals at E=0.

    Every finite E4M3 value has at most 4 significant bits, so float64 → float32 is exact. The
    NaN codes (S.1111.111) get NaN."""
    c = np.arange(256, dtype=np.int64)
    exp, man = (c >> 3) & 0xF, c & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (8 + man) * np.exp2(exp - 10.0))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


E4M3_TABLE = _e4m3_table()


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    """E4M3FN codes (uint8) → float32 values. NaN codes are not expected (the converter refuses
    them), so they fail here."""
    codes = np.asarray(codes, dtype=np.uint8)
    assert not ((codes & 0x7F) == 0x7F).any(), "NaN code in a reference input"
    return E4M3_TABLE[codes]


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns, round to nearest, ties to even (integer arithmetic)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(np.isnan(x), (u >> 16) | 0x40, rounded).astype(np.uint16)


def ref_dequant_bits(codes: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """bf16(f32(x[m, n]) * s[m // block, n // block]) as uint16 bit patterns."""
    m, n = codes.shape
    s = np.asarray(scale, dtype=np.float32)
    s_full = s[(np.arange(m) // block)[:, None], (np.arange(n) // block)[None, :]]
    with np.errstate(over="ignore"):  # overflow to ±inf is part of the formula
        prod = e4m3_to_f32(codes) * s_full  # IEEE float32 multiply
    assert prod.dtype == np.float32
    return f32_to_bf16_bits(prod)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a BF16 tensor."""
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def fp8_codes(t: torch.Tensor) -> np.ndarray:
    assert t.dtype == torch.float8_e4m3fn
    return t.contiguous().view(torch.uint8).numpy()


# --------------------------------------------------------------------------------------------
# the command line


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None


def run_cli(*args: object) -> CliResult:
    """``hetquant ARGS`` in-process. The root logger is emptied for the call so that the command's
    ``logging.basicConfig`` installs its stderr handler as in a real process; restored after."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        res = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=True)
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = saved
        root.setLevel(level)
    exc = res.exception if not isinstance(res.exception, SystemExit) else None
    return CliResult(res.exit_code, res.stdout, res.stderr, exc)


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    return run_cli


HETQUANT_MAIN = "import sys; from hetquant.convert.cli import main; sys.exit(main())"
# Hooks for children (tests/child_hooks/sitecustomize.py, on the child's PYTHONPATH): they act in
# the child and in the worker processes it spawns. ``slow_jobs``: the tiny model converts in
# about a second; slowed down, it can be killed mid-run. ``truncate``: a source file emptied
# under the job about to read it (SIGBUS). ``kill_workers``: workers die as if OOM-killed.
CHILD_HOOKS = REPO / "tests" / "child_hooks"


def start_hetquant(
    args: Sequence[object],
    slow_jobs: float | None = None,
    setup: str = "",
    truncate: Path | None = None,
    kill_workers: str | None = None,
) -> subprocess.Popen:
    """Start ``hetquant ARGS`` as a separate process in its own process group (stdout/stderr
    piped); ``setup``: Python statements the child runs first (e.g. registering a test recipe)."""
    env = dict(os.environ)
    hooks = {"HETQUANT_TEST_SLOW_JOBS": slow_jobs, "HETQUANT_TEST_TRUNCATE": truncate}
    hooks["HETQUANT_TEST_KILL_WORKERS"] = kill_workers
    hooks = {k: str(v) for k, v in hooks.items() if v is not None}
    if hooks:
        env |= hooks
        paths = [str(CHILD_HOOKS), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.Popen(
        [sys.executable, "-c", f"{setup}\n{HETQUANT_MAIN}", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,  # its own process group: the fixture can end every process it started
    )


def process_group(pgid: int) -> list[int]:
    """PIDs of the live (not zombie) processes of process group ``pgid`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:  # it ended while we looked
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def journal_jobs(out: Path) -> list[int]:
    """Job ids in the journal of the convert into ``out`` (empty before it starts)."""
    try:
        lines = (out / PARTIAL / "journal").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [int(x) for x in lines[1:] if x.strip().isdigit()]


def wait_for_jobs(proc: subprocess.Popen, out: Path, n: int) -> None:
    """Wait until the convert ``proc`` into ``out`` has journaled ``n`` jobs."""
    deadline = time.monotonic() + 300  # a hang guard, not a performance threshold
    while len(journal_jobs(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the child never journaled {n} jobs"
        time.sleep(0.02)


def error_line(stderr: str) -> str:
    """The one ``error: …`` line of a failed command's stderr; progress lines (every 10 s of a
    long run) may come before it, nothing else."""
    lines = [x for x in stderr.splitlines() if not x.startswith("INFO hetquant: converted ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@contextmanager
def tmpfs(
    path: Path, size: str, *, read_only: bool = False, inodes: int | None = None
) -> Iterator[Path]:
    """A tmpfs of ``size`` (and at most ``inodes`` files) mounted at ``path`` (created), or a
    skip saying why it cannot be."""
    path.mkdir()
    opts = f"size={size}" + (",ro" if read_only else "")
    opts += f",nr_inodes={inodes}" if inodes else ""
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no mount command here; the simulated variant of this case still runs")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}: needs root); the simulated variant of this case still runs")  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def hetquant_proc() -> Callable[..., subprocess.Popen]:
    procs: list[subprocess.Popen] = []

    def start(args: Sequence[object], **hooks: Any) -> subprocess.Popen:
        p = start_hetquant(args, **hooks)
        procs.append(p)
        return p

    yield start
    for p in procs:  # never leave a process behind (workers included), even when the test failed
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()


# --------------------------------------------------------------------------------------------
# sources and artifacts


@pytest.fixture
def tiny_src(tmp_path: Path) -> Path:
    """A private copy of the tiny FP8 checkpoint (tests may corrupt it)."""
    dst = tmp_path / "src"
    shutil.copytree(TINY, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_ro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy of the tiny checkpoint per session: the source of every session artifact and of
    the runs compared with them (the manifest records the source path, so they share it).
    Read-only: ``test_source_is_never_written`` checks it against ``tiny_ro_hashes``."""
    dst = tmp_path_factory.mktemp("tiny") / "tiny-deepseek-v3"
    shutil.copytree(TINY, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_ro_hashes(tiny_ro: Path) -> dict[str, str]:
    return tree_hashes(tiny_ro)


TINY_QWEN3 = REPO / "examples" / "tiny-qwen3-moe" / "make_tiny.py"


def make_tiny_qwen3() -> Any:
    """``examples/tiny-qwen3-moe/make_tiny.py`` as a namespace (``write_checkpoint``, ``CONFIG``)."""
    import runpy
    from types import SimpleNamespace

    return SimpleNamespace(**runpy.run_path(str(TINY_QWEN3)))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3-MoE checkpoint, generated once per session: {"fp8": dir, "bf16": dir}.
    Read-only: copy before corrupting."""
    base, gen = tmp_path_factory.mktemp("tiny-qwen3"), make_tiny_qwen3()
    return {d: gen.write_checkpoint(base / d, d) for d in ("fp8", "bf16")}


TINY_QWEN3_VL = REPO / "examples" / "tiny-qwen3-vl-moe" / "make_tiny.py"


def make_tiny_qwen3_vl() -> Any:
    """``examples/tiny-qwen3-vl-moe/make_tiny.py`` as a namespace (``write_checkpoint``, ...)."""
    import runpy
    from types import SimpleNamespace

    return SimpleNamespace(**runpy.run_path(str(TINY_QWEN3_VL)))


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3-VL-MoE checkpoint (transformers' classes, vision tower included), generated
    once per session: {"bf16": dir (fused experts), "fp8": dir (per expert)}. Read-only."""
    base, gen = tmp_path_factory.mktemp("tiny-qwen3-vl"), make_tiny_qwen3_vl()
    return {d: gen.write_checkpoint(base / d, d) for d in ("bf16", "fp8")}


TINY_V4 = REPO / "examples" / "tiny-deepseek-v4" / "make_tiny.py"


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny DeepSeek-V4 (transformers' classes), generated once per session: {"deepseek":
    dir (DeepSeek's FP8 + FP4 layout, MTP layer), "transformers": dir (its BF16 save)}. Read-only."""
    import runpy

    base, gen = tmp_path_factory.mktemp("tiny-v4"), runpy.run_path(str(TINY_V4))
    return {k: gen["write_checkpoint"](base / k, k) for k in ("deepseek", "transformers")}


@pytest.fixture(scope="session")
def tiny_v4_vllm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny DeepSeek-V4 at the attention dimensions vLLM's CPU build serves (``--dims vllm``:
    head_dim 512, rope 64, index_head_dim 128), both layouts as ``tiny_v4``. Read-only."""
    import runpy

    base, gen = tmp_path_factory.mktemp("tiny-v4-vllm"), runpy.run_path(str(TINY_V4))
    return {k: gen["write_checkpoint"](base / k, k, "vllm") for k in ("deepseek", "transformers")}


def _convert_once(
    src: Path, tmp_path_factory: pytest.TempPathFactory, name: str, *opts: str
) -> Path:
    out = tmp_path_factory.mktemp(name) / "out"
    res = run_cli("convert", src, out, "--recipe", "bf16", *opts)
    assert res.exit_code == 0, res.stderr
    return out


@pytest.fixture(scope="session")
def tiny_artifact(tiny_ro: Path, tiny_ro_hashes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 artifact of the tiny model, default options. Read-only for tests."""
    return _convert_once(tiny_ro, tmp_path_factory, "art", "--workers", "1")


@pytest.fixture(scope="session")
def tiny_artifact_1mb(
    tiny_ro: Path, tiny_ro_hashes, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """bf16 artifact of the tiny model in 1 MB shards. Read-only for tests."""
    return _convert_once(tiny_ro, tmp_path_factory, "art1mb", "--max-shard-size", "1MB")


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ascend-hybrid artifact of the tiny model (per-channel CPU experts). Read-only for tests."""
    from hetquant.convert import SourceCheckpoint, convert, get_recipe

    out = tmp_path_factory.mktemp("hybrid") / "art"
    convert(SourceCheckpoint.open(TINY), out, get_recipe("ascend-hybrid"), max_shard_size=10**9)
    return out


@pytest.fixture
def artifact_copy(tiny_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of ``tiny_artifact`` (tests may corrupt it)."""
    dst = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, dst)
    return dst


def make_kimi_k2(out: Path, variant: str = "instruct") -> Path:
    """The tiny Kimi K2 checkpoint (``examples/kimi-k2/make_tiny.py``) written into ``out``."""
    runpy.run_path(str(REPO / "examples" / "kimi-k2" / "make_tiny.py"))["write_checkpoint"](
        out, variant
    )
    return out
