"""The native INT4 GEMV's instruction paths that this host cannot run, run elsewhere and
compared bit for bit with the x86 paths of the real module on this (x86-64) host:

- aarch64: the kernel's translation unit (``int4_gemv._CPP_SOURCE``) and
  ``int4_gemv_driver.cpp`` cross-compiled with ``aarch64-linux-gnu-g++`` (static) and run with
  ``qemu-aarch64 -cpu max`` (FEAT_DotProd: the run-time dispatch must pick ``neon_dotprod``; the
  generic path is run too) and ``-cpu cortex-a53`` (ARMv8.0, no dot product: dispatch must fall
  back to generic, also when NEON is asked for);
- x86 AVX2, AVX-512 VNNI and AMX-INT8 on a CPU without them: the same sources built with
  ``-DHQ_SIMDE`` on SIMDe's portable implementations of the intrinsics (``libsimde-dev``; the AMX
  tile instructions emulated in ``int4_gemv_amx.cpp``), run here with each path — also the
  routed-expert sums of ``int4_moe.cpp`` (x86 only: their SiLU uses the C library's ``expf``).

Every result must equal, as float32 bits, what every x86 path of this CPU gives through
``int4_gemv`` — on golden inputs with hand-computed results and on random shapes (odd row
counts, K of every tail length, strided rows and scale rows, 1..16 tokens, both precisions,
per-channel and grouped 32 / 64 / 128).

Needs the Debian packages ``g++-aarch64-linux-gnu``, ``qemu-user`` (or ``qemu-user-static``) and
``libsimde-dev``; ``.ci/run`` installs them and sets ``HETQUANT_REQUIRE_CROSS=1``, under which a
missing tool fails the test instead of skipping it. Emulation says nothing about speed.
"""

from __future__ import annotations

import platform
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gemv_reference import grouped_native_order, order_sensitive_grouped
from support import aarch64_tools, missing_cross_tool

from hetquant.formats.native import DEFAULT_FLAGS, find_compiler
from hetquant.runtime.kernels import int4_gemv as G
from hetquant.runtime.kernels.int4_moe import int4_moe

HERE = Path(__file__).resolve().parent
GENERIC, AVX2, VNNI, NEON, AMX = 1, 2, 3, 4, 5  # the kernel's codes for its paths
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


def _build(cxx: str, out: Path, *flags: str) -> Path:
    """The kernel's translation unit plus the driver, compiled by ``cxx`` into ``out``."""
    src = out.parent / f"{out.name}-kernel.cpp"
    src.write_text(G._CPP_SOURCE, encoding="utf-8")
    cmd = [cxx, *flags, "-o", str(out), str(src), str(HERE / "int4_gemv_driver.cpp"), "-pthread"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module", autouse=True)
def _x86_host() -> None:
    if platform.machine() != "x86_64":
        pytest.skip("compares against the x86 paths: run on an x86-64 host")
    if not G.native_available():
        pytest.skip(f"native int4 kernel unavailable on this host: {G.native_info()['error']}")


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(qemu, driver): the aarch64 driver, statically linked, and qemu user mode to run it."""
    cxx, qemu = aarch64_tools()
    flags = [f for f in DEFAULT_FLAGS if f not in ("-shared", "-fPIC")]
    exe = _build(cxx, tmp_path_factory.mktemp("aarch64") / "driver", *flags, "-static")
    return qemu, str(exe)


@pytest.fixture(scope="module")
def simde(tmp_path_factory: pytest.TempPathFactory) -> tuple[str]:
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
    exe = _build(
        cxx, tmp_path_factory.mktemp("simde") / "driver", "-O0", "-std=c++17", "-DHQ_SIMDE"
    )
    return (str(exe),)


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
    Case(9, 7168, 17),  # token-blocked (GEMM-shaped) order: 17 tokens in blocks of 6
    Case(37, 514, 30, rs_pad=9),  # AMX: 90 token-planes, two sweeps; partial row block and chunk
    Case(20, 130, 27, precision="fast"),  # AMX: 54 token-planes at two digits
    Case(150, 258, 4, rs_pad=2),  # AMX: groups of four 16-row blocks, the last one partial
    Case(1, 32, 1, group=32),
    Case(5, 96, 3, group=32, ss_pad=1),
    Case(7, 384, 1, group=64, rs_pad=5),
    Case(13, 544, 5, group=32, precision="fast"),
    Case(3, 1056, 16, group=32),
    Case(5, 7168, 18, group=32),  # token-blocked
    Case(33, 1152, 7, group=128, rs_pad=64, ss_pad=3),
    Case(65, 2080, 1, group=32),
    Case(9, 7168, 2, group=128),
    Case(6, 2048, 1, group=64),
]


@dataclass(frozen=True)
class MoeCase:
    """A routed-expert sum (``int4_moe``) of t tokens' top-k over e experts [H = n, I]."""

    e: int
    n: int  # hidden size H: the result is [t, n] like a GEMV's
    inter: int
    t: int
    k: int
    precision: str = "high"


MOE = [MoeCase(5, 130, 24, 1, 2), MoeCase(6, 258, 40, 7, 3), MoeCase(4, 66, 36, 23, 4, "fast")]


def _moe_tensors(c: MoeCase) -> tuple:
    """(layer, x, experts, offsets, tokens, weights), entries grouped by expert."""
    g = torch.Generator().manual_seed(c.e * 131 + c.t)
    layer = {
        "gate_up_packed": torch.randint(0, 256, (c.e, 2 * c.inter, c.n // 2), dtype=torch.uint8, generator=g),
        "gate_up_scale": torch.rand(c.e, 2 * c.inter, generator=g) * 0.05 + 1e-3,
        "down_packed": torch.randint(0, 256, (c.e, c.n, c.inter // 2), dtype=torch.uint8, generator=g),
        "down_scale": torch.rand(c.e, c.n, generator=g) * 0.05 + 1e-3,
    }  # fmt: skip
    ids = torch.stack([torch.randperm(c.e, generator=g)[: c.k] for _ in range(c.t)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    experts, counts = torch.unique_consecutive(ids[order], return_counts=True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    x = torch.randn(c.t, c.n, generator=g) * 2
    return layer, x, experts, offsets, order // c.k, torch.rand(ids.numel(), generator=g)


def _host_moe(c: MoeCase, tensors: tuple) -> torch.Tensor:
    """The x86 result of ``int4_moe``: every path of this CPU, asserted identical."""
    outs = []
    mp = pytest.MonkeyPatch()
    try:
        for isa in G.isa_names("x86_64"):
            mp.setenv("HETQUANT_INT4_ISA", isa)
            outs.append(int4_moe(*tensors, backend="native", threads=2, precision=c.precision))
    finally:
        mp.undo()
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int32), outs[0].view(torch.int32))
    return outs[0]


def _moe_bytes(c: MoeCase, tensors: tuple, isa: int) -> list[bytes]:
    layer, x, experts, offsets, tokens, weights = tensors
    hdr = (2, 2 * c.inter, c.n, c.e, c.t, G.PRECISIONS[c.precision], isa, experts.numel())
    out = [struct.pack("<10q", *hdr, tokens.numel(), 2)]
    for key in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"):
        out.append(layer[key].contiguous().numpy().tobytes())
    out.append(x.float().contiguous().numpy().tobytes())
    out += [t.to(torch.int64).numpy().tobytes() for t in (experts, offsets, tokens)]
    out.append(weights.float().numpy().tobytes())
    return out


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


def _write_input(path: Path, cases: list[tuple[Case, tuple]], isa: int) -> None:
    out = [b"HQG1", struct.pack("<q", len(cases))]
    for c, tensors in cases:
        if isinstance(c, MoeCase):
            out += _moe_bytes(c, tensors, isa)
            continue
        packed, scale, x = tensors
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


def _run(prefix: tuple[str, ...], cases, isa: int, tmp: Path) -> tuple[int, list]:
    """Run ``cases`` with path ``isa`` (0: best) through a driver command; (best, results)."""
    src, dst = tmp / f"in-{isa}.bin", tmp / f"out-{isa}.bin"
    _write_input(src, cases, isa)
    res = subprocess.run([*prefix, str(src), str(dst)], capture_output=True, text=True, timeout=900)
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
    for c, (packed, scale, x), want in _golden() + _ordered():
        assert _host(packed, scale, x, c.precision).flatten().tolist() == want


def _ordered() -> list[tuple[Case, tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[float]]]:
    """Grouped cases whose float32 bits depend on the order of the float step (huge products
    that cancel, gemv_reference.order_sensitive_grouped), with the bits of the documented
    order (grouped_native_order)."""
    out = []
    for n, k, t, g in ((5, 2080, 1, 32), (4, 1536, 2, 64), (3, 1536, 1, 128)):
        packed, scale, m = order_sensitive_grouped(n, k, t, g, seed=n)
        want = grouped_native_order(packed, scale, m, -21).flatten().tolist()
        out.append((Case(n, k, t, group=g), (packed, scale, m.float() * 2.0**-21), want))
    return out


def _check(prefix, best: int, requests: dict[int, int], tmp: Path, moe: bool = False) -> None:
    """Every case through ``prefix`` for each requested path (request → the path that must run),
    bit-identical to this host's x86 results; the golden ones equal their hand-computed values,
    the order-sensitive ones the bits of the documented float order. ``moe``: also the
    routed-expert sums of ``int4_moe.cpp`` — on x86 only: their SiLU calls the C library's
    ``expf``, whose last bit differs between C libraries (as torch's ``F.silu`` does)."""
    golden = _golden() + _ordered()
    cases = [(c, t) for c, t, _ in golden] + [(c, _tensors(c)) for c in RANDOM]
    want = [_host(*t, c.precision) for c, t in cases]
    if moe:
        sums = [(c, _moe_tensors(c)) for c in MOE]
        cases += sums
        want += [_host_moe(c, t) for c, t in sums]
    for isa, used in requests.items():
        got_best, results = _run(prefix, cases, isa, tmp)
        assert got_best == best  # run-time dispatch from the CPU's features
        for (c, _), w, (rc, y) in zip(cases, want, results, strict=True):
            assert rc == used, c
            assert torch.equal(y.view(torch.int32), w.view(torch.int32)), (c, isa)
        for (_, _, expected), (_, y) in zip(golden, results, strict=False):
            assert (
                y.flatten().view(torch.int32).tolist()
                == torch.tensor(expected).view(torch.int32).tolist()
            )


@pytest.mark.parametrize(
    ("cpu", "best", "requests"),
    [
        ("max", NEON, {0: NEON, GENERIC: GENERIC}),  # FEAT_DotProd (AT_HWCAP): NEON is best
        ("cortex-a53", GENERIC, {0: GENERIC, NEON: GENERIC}),  # ARMv8.0: generic, even if asked
    ],
)
def test_aarch64_paths_bit_identical_to_x86(aarch64, tmp_path, cpu, best, requests) -> None:
    qemu, exe = aarch64
    _check((qemu, "-cpu", cpu, exe), best, requests, tmp_path)


def test_x86_paths_on_simde_bit_identical(simde, tmp_path) -> None:
    _check(simde, AMX, {AMX: AMX, VNNI: VNNI, AVX2: AVX2, GENERIC: GENERIC}, tmp_path, moe=True)
