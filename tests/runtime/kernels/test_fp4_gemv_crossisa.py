"""The native FP4 GEMV's paths this host may lack, compared bit for bit with the torch reference
(``fp4_gemv_int8``) and so with every x86 path of this host (``test_fp4_gemv.py``):

- aarch64: the kernel library's translation unit (``int4_gemv._CPP_SOURCE``) and
  ``fp4_gemv_driver.cpp`` cross-compiled with ``aarch64-linux-gnu-g++`` (static), run with
  ``qemu-aarch64 -cpu max`` (FEAT_DotProd: dispatch picks ``neon_dotprod``; generic run too) and
  ``-cpu cortex-a53`` (ARMv8.0: dispatch falls back to generic, also when NEON is asked for);
- x86 AVX2 and AVX-512 VNNI on a CPU without them: the same sources with ``-DHQ_SIMDE`` on
  SIMDe's portable intrinsics (``libsimde-dev``), every path run here.

Needs ``g++-aarch64-linux-gnu``, ``qemu-user`` and ``libsimde-dev``; ``HETQUANT_REQUIRE_CROSS=1``
(``.ci/run``) makes a missing tool a failure instead of a skip. Emulation says nothing about speed.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import torch
from support import aarch64_tools, missing_cross_tool
from test_fp4_gemv import SHAPES, data

from hetquant.formats.fp4_cpu import fp4_gemv_int8
from hetquant.formats.native import DEFAULT_FLAGS, find_compiler
from hetquant.runtime.kernels import int4_gemv as G

HERE = Path(__file__).resolve().parent
GENERIC, AVX2, VNNI, NEON = 1, 2, 3, 4  # the kernel's codes for its paths


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(qemu, driver): the aarch64 driver, statically linked, and qemu user mode to run it."""
    cxx, qemu = aarch64_tools()
    flags = [f for f in DEFAULT_FLAGS if f not in ("-shared", "-fPIC")]
    return qemu, _build(cxx, tmp_path_factory.mktemp("fp4-aarch64"), *flags, "-static")


@pytest.fixture(scope="module")
def simde(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The x86 paths on SIMDe, as a native driver (-O0: at -O3 the build takes minutes)."""
    cxx = find_compiler()
    probe = subprocess.run(
        [cxx or "g++", "-x", "c++", "-fsyntax-only", "-"],
        input="#include <simde/x86/avx512.h>\n",
        capture_output=True,
        text=True,
    )
    if cxx is None or probe.returncode != 0:
        missing_cross_tool("needs a C++ compiler and SIMDe's headers (Debian: libsimde-dev)")
    return _build(cxx, tmp_path_factory.mktemp("fp4-simde"), "-O0", "-std=c++17", "-DHQ_SIMDE")


def _build(cxx: str, out: Path, *flags: str) -> str:
    """The kernel's translation unit plus the driver, compiled by ``cxx`` into ``out``."""
    src = out / "kernel.cpp"
    src.write_text(G._CPP_SOURCE, encoding="utf-8")
    cmd = [cxx, *flags, "-o", str(out / "driver"), str(src), str(HERE / "fp4_gemv_driver.cpp")]
    res = subprocess.run([*cmd, "-pthread"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(out / "driver")


def _cases() -> list[tuple]:
    return [data(*shape) for shape in SHAPES]


def _run(cmd: list[str], cases: list[tuple], isa: int, tmp: Path) -> tuple[int, list]:
    """(best path, [(rc, y)]) of the driver on ``cases`` with path ``isa`` (0: best)."""
    blob = [b"HQF1", struct.pack("<q", len(cases))]
    for packed, scale, x in cases:
        n, kb = packed.shape
        t = x.shape[0]
        rs = packed.stride(0) if n > 1 else kb
        ss = scale.stride(0) if n > 1 else kb // 16
        blob.append(struct.pack("<7q", n, 2 * kb, t, isa, rs, ss, 2))
        blob.append(packed.as_strided((n, rs), (rs, 1)).contiguous().numpy().tobytes())
        u8 = scale.view(torch.uint8)
        blob.append(u8.as_strided((n, ss), (ss, 1)).contiguous().numpy().tobytes())
        blob.append(x.float().contiguous().numpy().tobytes())
    src, dst = tmp / f"in-{isa}.bin", tmp / f"out-{isa}.bin"
    src.write_bytes(b"".join(blob))
    res = subprocess.run([*cmd, str(src), str(dst)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    raw = dst.read_bytes()
    assert raw[:4] == b"HQR1"
    best, pos, results = struct.unpack_from("<q", raw, 4)[0], 12, []
    for packed, _, x in cases:
        count = x.shape[0] * packed.shape[0]
        rc = struct.unpack_from("<q", raw, pos)[0]
        y = torch.frombuffer(bytearray(raw[pos + 8 : pos + 8 + 4 * count]), dtype=torch.float32)
        results.append((rc, y.view(x.shape[0], packed.shape[0])))
        pos += 8 + 4 * count
    return best, results


@pytest.mark.parametrize(("cpu", "best"), [("max", NEON), ("cortex-a53", GENERIC)])
def test_aarch64_paths_are_the_reference(aarch64, tmp_path, cpu, best) -> None:
    qemu, driver = aarch64
    cases = _cases()
    refs = [fp4_gemv_int8(*c) for c in cases]
    for isa in (0, GENERIC, NEON):
        got_best, results = _run([qemu, "-cpu", cpu, driver], cases, isa, tmp_path)
        assert got_best == best
        for (rc, y), ref in zip(results, refs, strict=True):
            assert rc == (GENERIC if isa == GENERIC else best)
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), (cpu, isa)


def test_x86_paths_on_simde_are_the_reference(simde, tmp_path) -> None:
    cases = _cases()
    refs = [fp4_gemv_int8(*c) for c in cases]
    for isa in (GENERIC, AVX2, VNNI):
        _, results = _run([simde], cases, isa, tmp_path)
        for (rc, y), ref in zip(results, refs, strict=True):
            assert rc == isa
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), isa
