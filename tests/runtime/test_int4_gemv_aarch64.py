"""The aarch64 paths of the native INT4 GEMV, run under qemu user mode and compared bit for bit
with the x86 paths of the real module on this host.

The kernel's translation unit (``int4_gemv._CPP_SOURCE``) and ``int4_gemv_driver.cpp`` are
cross-compiled with ``aarch64-linux-gnu-g++`` (static) and run with ``qemu-aarch64 -cpu max``
(FEAT_DotProd: the run-time dispatch must pick ``neon_dotprod``; the generic path is run too) and
``-cpu cortex-a53`` (ARMv8.0, no dot product: dispatch must fall back to generic). Every result
must equal, as float32 bits, what every x86 path (generic, AVX2, AVX-512 VNNI, as this CPU has
them) gives through ``int4_gemv`` — on golden inputs with hand-computed results and on random
shapes (odd row counts, K of every tail length, strided rows and scale rows, 1..16 tokens, both
precisions, per-channel and grouped 32 / 64 / 128).

Needs the Debian packages ``g++-aarch64-linux-gnu`` and ``qemu-user`` (or ``qemu-user-static``);
``.ci/run`` installs them and sets ``HETQUANT_REQUIRE_AARCH64=1``, under which a missing tool
fails the test instead of skipping it. Emulation says nothing about speed.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hetquant.formats._native import DEFAULT_FLAGS
from hetquant.runtime import int4_gemv as G

HERE = Path(__file__).resolve().parent
CROSS = "aarch64-linux-gnu-g++"
QEMUS = ("qemu-aarch64", "qemu-aarch64-static")
GENERIC, NEON = 1, 4  # the kernel's codes for its aarch64 paths
BF16_HALF, BF16_TWO = 0x3F00, 0x4000


@dataclass(frozen=True)
class Case:
    n: int
    k: int
    t: int
    group: int = 0  # 0: per-channel F32 scales
    precision: str = "high"
    rs_pad: int = 0  # extra bytes per weight row (strided rows, as a subpool's down slice)
    ss_pad: int = 0  # extra scales per row (strided scale rows)
    seed: int = 0


def _tools() -> tuple[str, str]:
    cxx = shutil.which(CROSS)
    qemu = next((q for q in map(shutil.which, QEMUS) if q), None)
    if cxx is None or qemu is None:
        msg = (
            f"needs {CROSS} and qemu-aarch64 (Debian: apt-get install g++-aarch64-linux-gnu "
            "qemu-user); .ci/run installs them"
        )
        if os.environ.get("HETQUANT_REQUIRE_AARCH64") == "1":
            pytest.fail(msg + " — HETQUANT_REQUIRE_AARCH64=1, so this must run")
        pytest.skip(msg)
    return cxx, qemu


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if not G.native_available():
        pytest.skip(f"native int4 kernel unavailable on this host: {G.native_info()['error']}")
    cxx, qemu = _tools()
    d = tmp_path_factory.mktemp("aarch64")
    (d / "kernel.cpp").write_text(G._CPP_SOURCE, encoding="utf-8")
    flags = [f for f in DEFAULT_FLAGS if f not in ("-shared", "-fPIC")]
    exe = d / "driver"
    cmd = [cxx, *flags, "-static", "-pthread", "-o", str(exe), str(d / "kernel.cpp")]
    res = subprocess.run(
        [*cmd, str(HERE / "int4_gemv_driver.cpp")], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return exe, qemu


# ------------------------------------------------------------------------------------------------
# inputs


def _tensors(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights (rows of K/2 bytes, stride K/2 + rs_pad), scales (stride K/g + ss_pad), x."""
    g = torch.Generator().manual_seed(c.seed or c.n * 7919 + c.k * 31 + c.t)
    kb = c.k // 2
    packed = torch.randint(0, 256, (c.n, kb + c.rs_pad), dtype=torch.uint8, generator=g)[:, :kb]
    if c.group:
        ng = c.k // c.group
        s = (torch.rand(c.n, ng + c.ss_pad, generator=g) * 0.2 + 1e-3).to(torch.bfloat16)
        scale = s[:, :ng]
    else:
        scale = torch.rand(c.n, generator=g) * 0.1 + 1e-3
    x = torch.randn(c.t, c.k, generator=g) * torch.rand(c.t, 1, generator=g) * 10
    return packed, scale, x


def _golden() -> list[tuple[Case, tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[float]]]:
    """Hand-computed cases whose results are exact (integer-valued sums, power-of-two scales)."""
    # per-channel, K = 8: row 0 codes 15 1 9 8 8 8 8 8 (q = 7 -7 1 0 ...), s = 0.5;
    # row 1 codes 0 15 8 8 8 8 8 3 (q = -8 7 0 0 0 0 0 -5), s = 0.25; byte j = c[2j] | c[2j+1] << 4
    packed = torch.tensor([[0x1F, 0x89, 0x88, 0x88], [0xF0, 0x88, 0x88, 0x38]], dtype=torch.uint8)
    x = torch.tensor([[1.0, 2, 3, 4, -1, -2, -3, -4], [0.5, 1, 1.5, 2, -0.5, -1, -1.5, -2]])
    # token 0: row 0 0.5·(7 - 14 + 3) = -2, row 1 0.25·(-8 + 14 + 20) = 6.5; token 1: half that
    per_channel = (Case(2, 8, 2), (packed, torch.tensor([0.5, 0.25]), x), [-2.0, 6.5, -1.0, 3.25])
    # grouped, K = 64, g = 32: all codes 8 but c[0] = 15, c[33] = 1, c[63] = 0; scales 0.5, 2;
    # x[k] = (k - 32) / 4: 0.5·(7·-8) + 2·(-7·0.25 + -8·7.75) = -28 - 127.5 = -155.5
    row = [0x88] * 32
    row[0], row[16], row[31] = 0x8F, 0x18, 0x08
    scale = torch.tensor([[BF16_HALF, BF16_TWO]], dtype=torch.int16).view(torch.bfloat16)
    xg = ((torch.arange(64, dtype=torch.float32) - 32) / 4)[None]
    grouped = (
        Case(1, 64, 1, group=32),
        (torch.tensor([row], dtype=torch.uint8), scale, xg),
        [-155.5],
    )
    return [per_channel, grouped]


RANDOM = [
    Case(1, 2, 1),
    Case(5, 30, 3),
    Case(7, 126, 1, rs_pad=3),
    Case(13, 130, 5, precision="fast"),
    Case(3, 254, 16),
    Case(33, 1002, 2, rs_pad=17),
    Case(65, 2050, 1),
    Case(9, 7168, 1),
    Case(1, 32, 1, group=32),
    Case(5, 96, 3, group=32, ss_pad=1),
    Case(7, 384, 1, group=64, rs_pad=5),
    Case(13, 544, 5, group=32, precision="fast"),
    Case(3, 1056, 16, group=32),
    Case(33, 1152, 7, group=128, rs_pad=64, ss_pad=3),
    Case(65, 2080, 1, group=32),
    Case(9, 7168, 2, group=128),
    Case(6, 2048, 1, group=64),
]


def _host(packed, scale, x, precision: str) -> torch.Tensor:
    """The x86 result: every path of this CPU, asserted identical."""
    outs = []
    mp = pytest.MonkeyPatch()
    try:
        for isa in G.isa_names("x86_64"):
            mp.setenv("HETQUANT_INT4_ISA", isa)
            outs.append(
                G.int4_gemv(packed, scale, x, backend="native", threads=2, precision=precision)
            )
    finally:
        mp.undo()
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int32), outs[0].view(torch.int32))
    return outs[0]


def _write_input(path: Path, cases: list[tuple[Case, tuple],], isa: int) -> None:
    out = [b"HQG1", struct.pack("<q", len(cases))]
    for c, (packed, scale, x) in cases:
        rs = packed.stride(0) if c.n > 1 else c.k // 2
        ss = (scale.stride(0) if c.n > 1 else scale.shape[1]) if c.group else 0
        hdr = (
            1 if c.group else 0,
            c.n,
            c.k,
            c.group,
            c.t,
            G.PRECISIONS[c.precision],
            isa,
            rs,
            ss,
            2,
        )
        out.append(struct.pack("<10q", *hdr))
        out.append(packed.as_strided((c.n, rs), (rs, 1)).contiguous().numpy().tobytes())
        if c.group:
            out.append(
                scale.as_strided((c.n, ss), (ss, 1))
                .contiguous()
                .view(torch.int16)
                .numpy()
                .tobytes()
            )
        else:
            out.append(scale.float().numpy().tobytes())
        out.append(x.float().contiguous().numpy().tobytes())
    path.write_bytes(b"".join(out))


def _run(
    driver, cpu: str, cases, isa: int, tmp: Path
) -> tuple[int, list[tuple[int, torch.Tensor]]]:
    exe, qemu = driver
    src, dst = tmp / f"in-{cpu}-{isa}.bin", tmp / f"out-{cpu}-{isa}.bin"
    _write_input(src, cases, isa)
    res = subprocess.run(
        [qemu, "-cpu", cpu, str(exe), str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = dst.read_bytes()
    assert data[:4] == b"HQR1"
    best = struct.unpack_from("<q", data, 4)[0]
    pos, results = 12, []
    for c, _ in cases:
        rc = struct.unpack_from("<q", data, pos)[0]
        y = torch.frombuffer(
            bytearray(data[pos + 8 : pos + 8 + 4 * c.t * c.n]), dtype=torch.float32
        )
        results.append((rc, y.reshape(c.t, c.n)))
        pos += 8 + 4 * c.t * c.n
    assert pos == len(data)
    return best, results


# ------------------------------------------------------------------------------------------------
# tests


def test_golden_cases_exact_on_this_host() -> None:
    for c, (packed, scale, x), want in _golden():
        assert _host(packed, scale, x, c.precision).flatten().tolist() == want


@pytest.mark.parametrize(
    ("cpu", "best", "requests"),
    [
        ("max", NEON, (0, GENERIC)),  # FEAT_DotProd: best is NEON; the generic path is run too
        ("cortex-a53", GENERIC, (0, NEON)),  # ARMv8.0: best and a NEON request both get generic
    ],
)
def test_aarch64_paths_bit_identical_to_x86(driver, tmp_path, cpu, best, requests) -> None:
    golden = _golden()
    cases = [(c, t) for c, t, _ in golden] + [(c, _tensors(c)) for c in RANDOM]
    want = [_host(*t, c.precision) for c, t in cases]
    for isa in requests:
        got_best, results = _run(driver, cpu, cases, isa, tmp_path)
        assert got_best == best  # run-time dispatch from the CPU's features (AT_HWCAP)
        used = isa if isa and (isa == GENERIC or best == NEON) else best
        for (c, _), w, (rc, y) in zip(cases, want, results, strict=True):
            assert rc == used, c
            assert torch.equal(y.view(torch.int32), w.view(torch.int32)), c
        for (_, _, expected), (_, y) in zip(golden, results, strict=False):
            assert y.flatten().tolist() == expected
