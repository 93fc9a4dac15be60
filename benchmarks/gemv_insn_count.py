"""Instructions per 64 weight bytes of each INT4 GEMV path (no speed can be measured for aarch64
or AVX-512 here: this counts work instead).

Method. The kernel's translation unit (``int4_gemv._CPP_SOURCE``) and the test driver
(``tests/runtime/kernels/int4_gemv_driver.cpp``) are built statically with the kernel's own flags
(``g++ -O3``; ``aarch64-linux-gnu-g++ -O3``) and run on one case (N rows × K, one token, 22-bit
activations, one thread) under qemu user mode with ``-d in_asm,exec,nochain``: every executed
translation block is logged, and the instructions of the blocks whose address lies in the
kernel's compute functions (the ``tile`` / ``gtile`` / ``Grouped*::tile`` / ``grouped_rows`` /
``step_neon`` / ``block_dot`` / ``run_*`` / ``run`` symbols of ``nm``, i.e. the weight loops and
their epilogues, not the activation rounding in ``gemv``) are summed:
a dynamic count, divided by N·K/2 / 64. x86: ``qemu-x86_64 -cpu max`` (AVX2, no AVX-512);
aarch64: ``qemu-aarch64 -cpu max`` (FEAT_DotProd). The AVX-512 VNNI paths cannot run under
qemu 7.2, so for them the steady-state loop is counted in the disassembly (``objdump``): the
loop (backward branch) holding the most ``vpdpbusd``, head to back-edge, plus for the grouped
kernel nothing else (its per-superblock epilogue is inside that loop). Beside every dynamic count
is the count of vector operations alone: SIMD instructions that compute (x86: ``v*`` but moves
and broadcasts; aarch64: instructions on ``v`` registers but loads, stores, moves and dups).

Usage: ``python benchmarks/gemv_insn_count.py`` (needs g++, aarch64-linux-gnu-g++,
qemu-user, binutils; about a minute) → ``benchmarks/results/gemv_insn_count.json``.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hetquant.formats.native import DEFAULT_FLAGS
from hetquant.runtime.kernels import int4_gemv as G

ROOT = Path(__file__).resolve().parents[1]
DRIVER = next(ROOT.glob("tests/**/int4_gemv_driver.cpp"))  # beside the runtime tests
OUT = ROOT / "benchmarks" / "results" / "gemv_insn_count.json"
N, K, GROUP = 8, 7168, 32
KERNEL_FN = re.compile(
    r"\(anonymous namespace\)::"
    r"(g?tile_\w+<|Grouped\w+::tile<|grouped_rows|run_\w+\(|run\(|block_dot\(|step_neon<)"
)
PATHS = {  # name: (machine, isa request)
    "x86 generic": ("x86_64", 1),
    "x86 avx2": ("x86_64", 2),
    "aarch64 generic": ("aarch64", 1),
    "aarch64 neon_dotprod": ("aarch64", 4),
}


def build(tmp: Path) -> dict[str, Path]:
    src = tmp / "kernel.cpp"
    src.write_text(G._CPP_SOURCE, encoding="utf-8")
    flags = [f for f in DEFAULT_FLAGS if f not in ("-shared", "-fPIC")]
    exes = {}
    for machine, cxx in (("x86_64", "g++"), ("aarch64", "aarch64-linux-gnu-g++")):
        exe = tmp / f"driver-{machine}"
        cmd = [cxx, *flags, "-static", "-pthread", "-o", str(exe), str(src), str(DRIVER)]
        subprocess.run(cmd, check=True, capture_output=True)
        exes[machine] = exe
    return exes


def case_file(path: Path, grouped: bool, isa: int) -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    x = torch.randn(K, generator=g)
    ss = K // GROUP if grouped else 0
    hdr = (int(grouped), N, K, GROUP if grouped else 0, 1, 3, isa, K // 2, ss, 1)
    scale = (
        (torch.rand(N, ss, generator=g) + 0.1).bfloat16().view(torch.int16)
        if grouped
        else torch.rand(N, generator=g) + 0.1
    )
    body = [b"HQG1", struct.pack("<q", 1), struct.pack("<10q", *hdr), packed.numpy().tobytes()]
    body += [scale.numpy().tobytes(), x.numpy().tobytes()]
    path.write_bytes(b"".join(body))


def kernel_ranges(exe: Path, machine: str) -> list[tuple[int, int]]:
    nm = "nm" if machine == "x86_64" else "aarch64-linux-gnu-nm"
    out = subprocess.run([nm, "-C", "--print-size", str(exe)], capture_output=True, text=True)
    ranges = []
    for line in out.stdout.splitlines():
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and parts[2] in "tT" and KERNEL_FN.search(parts[3]):
            start = int(parts[0], 16)
            ranges.append((start, start + int(parts[1], 16)))
    return ranges


_MOVES = ("mov", "vmov", "vzero", "vbroadcast", "ld", "st", "dup", "fmov", "umov", "ins", "prfm")


def _is_vector_op(line: str, machine: str) -> bool:
    """A SIMD data-processing instruction (not a load, store or register move). qemu 7.2's
    disassembler prints aarch64 ``sdot`` / ``udot`` as ``.byte``: they are recognised by their
    encoding (``insn & 0xbfe0fc00`` = ``0x0e809400`` / ``0x2e809400``)."""
    tokens = line.split(":", 1)[1].split()  # encoding (hex bytes or word), mnemonic, operands
    word = tokens[0] if tokens and re.fullmatch(r"[0-9a-f]{8}", tokens[0]) else None
    while tokens and re.fullmatch(r"[0-9a-f]{2}|[0-9a-f]{8}", tokens[0]):
        tokens.pop(0)
    op, asm = (tokens[0], " ".join(tokens)) if tokens else ("", "")
    if op.startswith(_MOVES):
        return False
    if machine == "x86_64":
        return op.startswith("v") or "%xmm" in asm
    if op == ".byte" and word is not None:
        return (int(word, 16) & 0xBFE0FC00) in (0x0E809400, 0x2E809400)
    return bool(re.search(r"\bv\d+\.", asm))


def dynamic_count(exe: Path, machine: str, grouped: bool, isa: int, tmp: Path) -> tuple[int, int]:
    """(instructions, vector operations) executed in the kernel's compute functions for one
    case."""
    inp, out, log = tmp / "in.bin", tmp / "out.bin", tmp / "qemu.log"
    case_file(inp, grouped, isa)
    qemu = f"qemu-{machine}"
    cmd = [qemu, "-cpu", "max", "-d", "in_asm,exec,nochain", "-D", str(log), str(exe)]
    subprocess.run([*cmd, str(inp), str(out)], check=True, capture_output=True)
    data = out.read_bytes()
    assert struct.unpack_from("<q", data, 12)[0] == isa, "the driver ran another path"
    sizes: dict[int, int] = {}
    vector: dict[int, int] = {}
    execs: dict[int, int] = {}
    block: int | None = None
    insn = re.compile(r"^0x([0-9a-f]+):\s")
    trace = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("IN:"):
                block = -1
                continue
            m = insn.match(line)
            if m and block is not None:
                if block == -1:
                    block = int(m.group(1), 16)
                    sizes[block] = vector[block] = 0
                sizes[block] += 1
                vector[block] += _is_vector_op(line, machine)
                continue
            if not line.strip():
                block = None
                continue
            m = trace.match(line)
            if m:
                pc = int(m.group(1), 16)
                execs[pc] = execs.get(pc, 0) + 1
    ranges = kernel_ranges(exe, machine)
    inside = [pc for pc in execs if any(a <= pc < b for a, b in ranges)]
    return (
        sum(execs[pc] * sizes.get(pc, 0) for pc in inside),
        sum(execs[pc] * vector.get(pc, 0) for pc in inside),
    )


def static_vnni(exe: Path, symbol: str) -> dict[str, int]:
    """The loop of ``symbol`` with the most vpdpbusd: instructions head to back-edge, and dots."""
    dis = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(exe)], capture_output=True, text=True
    ).stdout
    start = dis.index(symbol)
    body = dis[start : dis.index("\n\n", start)]
    lines = [ln for ln in body.splitlines()[1:] if re.match(r"^\s+[0-9a-f]+:", ln)]
    addr = [int(ln.split(":")[0], 16) for ln in lines]
    best = {"insns": 0, "dots": 0}
    for i, ln in enumerate(lines):
        m = re.search(r"\sj\w+\s+([0-9a-f]+) <", ln)
        if m and int(m.group(1), 16) < addr[i]:
            j = addr.index(int(m.group(1), 16))
            loop = lines[j : i + 1]
            dots = sum("vpdpbusd" in x for x in loop)
            if dots > best["dots"]:
                best = {"insns": len(loop), "dots": dots}
    return best


def main() -> int:
    res: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exes = build(tmp)
        units = N * K // 2 / 64
        for name, (machine, isa) in PATHS.items():
            for grouped in (False, True):
                count, vec = dynamic_count(exes[machine], machine, grouped, isa, tmp)
                key = "group32" if grouped else "per_channel"
                res.setdefault(name, {})[key] = round(count / units, 1)
                res.setdefault(name + " (vector ops)", {})[key] = round(vec / units, 1)
                print(
                    f"{name:22s} {key:12s} {count / units:7.1f} instructions, "
                    f"{vec / units:6.1f} vector operations / 64 weight bytes"
                )
        # AVX-512 VNNI, static: per 64 B of one row, one token, 3 digit planes: 6 vpdpbusd
        for key, sym, rows in (
            ("per_channel", "<void (anonymous namespace)::tile_vnni<4, 1, 3>", 4),
            ("group32", "<void (anonymous namespace)::gtile_vnni<2, 1, 3, 1>", 2),
        ):
            loop = static_vnni(exes["x86_64"], sym)
            per64 = loop["insns"] / (loop["dots"] / 6)
            res.setdefault("x86 avx512_vnni (static)", {})[key] = round(per64, 1)
            print(f"x86 avx512_vnni static {key:12s} {per64:7.1f} ({loop}, {rows} rows per tile)")
    doc = {
        "method": __doc__.split("\n\n")[1],
        "case": {"rows": N, "K": K, "tokens": 1, "precision": "high", "group": GROUP},
        "instructions_per_64_weight_bytes": res,
    }
    OUT.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
