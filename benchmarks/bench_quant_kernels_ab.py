"""The AWQ and NVFP4 quantize kernels of this tree against those of a base revision, side by side.

``formats/_quant_native.cpp`` as it is here and as it was at ``--base`` (a git revision), each
compiled into a small C++ driver with the library's own flags (``QUANT_LIBRARY.flags``, less
``-shared -fPIC``), run interleaved at every instruction path this CPU has (the kernels' own
``best_isa``: 3 AVX-512, 2 AVX2, 1 generic C++), pinned to one core (``--cpu``), on the same
BF16 weight [``--rows``, ``--cols``] (default DeepSeek's gate/up [2048, 7168], normal(0, 0.02)):
AWQ RTN group 128 and NVFP4 into the Ascend tiled layout. Best of ``--repeats`` in each process, ``--rounds``
processes per kernel; the ratio is base / this tree. Each driver prints a digest of every output
byte, and the two must agree (the kernels are bit-exact by contract): a mismatch is an error.

    python benchmarks/bench_quant_kernels_ab.py --base 272cfb1 [--cpu 3] [--json PATH]

``--base`` may also be a copy of the kernel file (on a machine whose clone lacks the revision);
the result records the sha256 of both sources.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _measure import machine_info, write_result  # noqa: E402

from hetquant.formats import _quant_native as qn  # noqa: E402
from hetquant.formats.native import find_compiler  # noqa: E402

SOURCE = "formats/_quant_native.cpp"
LINE = re.compile(r"awq ([\d.]+) ms nvfp4 ([\d.]+) ms digest (\w+) (\w+)")

# The driver: the kernel source is #included (its helpers are in an anonymous namespace).
# hq_awq_quantize took (NT, row0) from cdb433a on; NEW_AWQ says which signature the source has.
DRIVER = r"""
#include KERNELS
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
int main(int argc, char** argv) {
  const int64_t R = atoll(argv[1]), K = atoll(argv[2]), g = 128;
  const int isa = atoi(argv[3]), repeats = atoi(argv[4]);
  std::vector<uint16_t> w(R * K);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 0.02f);
  for (auto& x : w) { float f = nd(rng); uint32_t b; memcpy(&b, &f, 4); x = (uint16_t)(b >> 16); }
  std::vector<int32_t> qw(K * R / 8), qz(K / g * R / 8);
  std::vector<uint16_t> sc(K / g * R);
  std::vector<uint8_t> q(R * K / 2), s(R * K / 16);
  double ta = 1e9, tn = 1e9;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
#if NEW_AWQ
    int ra = hq_awq_quantize(w.data(), 1, R, K, g, qw.data(), qz.data(), sc.data(), R, 0, isa);
#else
    int ra = hq_awq_quantize(w.data(), 1, R, K, g, qw.data(), qz.data(), sc.data(), isa);
#endif
    auto t1 = std::chrono::steady_clock::now();
    int rn = hq_nvfp4_quantize(w.data(), 1, R, K, 1e-4f, q.data(), s.data(), 2, R, 0, isa);
    auto t2 = std::chrono::steady_clock::now();
    if (ra || rn) { printf("error %d %d\n", ra, rn); return 1; }
    ta = std::min(ta, std::chrono::duration<double>(t1 - t0).count());
    tn = std::min(tn, std::chrono::duration<double>(t2 - t1).count());
  }
  uint64_t da = 1469598103934665603ull, dn = da;  // FNV-1a of every output byte
  auto fnv = [](uint64_t& d, const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) d = (d ^ ((const uint8_t*)p)[i]) * 1099511628211ull;
  };
  fnv(da, qw.data(), qw.size() * 4);
  fnv(da, qz.data(), qz.size() * 4);
  fnv(da, sc.data(), sc.size() * 2);
  fnv(dn, q.data(), q.size()); fnv(dn, s.data(), s.size());
  printf("awq %.3f ms nvfp4 %.3f ms digest %016llx %016llx\n", ta * 1e3, tn * 1e3,
         (unsigned long long)da, (unsigned long long)dn);
  return 0;
}
"""


def build(source: str, out: Path, compiler: str) -> Path:
    """The driver around ``source`` (the kernel file's text), compiled to ``out``."""
    kernels = out.with_suffix(".kernels.cpp")
    kernels.write_text(source)
    driver = out.with_suffix(".cpp")
    driver.write_text(DRIVER)
    new_awq = "int64_t NT, int64_t row0, int isa) {\n  if (R < 0 || R % 8 || g <= 0" in source
    flags = [f for f in qn.QUANT_LIBRARY.flags if f not in ("-shared", "-fPIC")]
    cmd = [compiler, *flags, f'-DKERNELS="{kernels}"', f"-DNEW_AWQ={int(new_awq)}"]
    subprocess.run([*cmd, str(driver), "-o", str(out)], check=True)
    return out


def base_source(base: str) -> str:
    """The baseline kernel source: the file ``base``, else ``SOURCE`` at git revision ``base``."""
    if Path(base).is_file():
        return Path(base).read_text()
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{base}:{SOURCE}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def run(exe: Path, args: argparse.Namespace, isa: int) -> tuple[float, float, str]:
    """One process: (awq ms, nvfp4 ms, digest)."""
    cmd = [str(exe), str(args.rows), str(args.cols), str(isa), str(args.repeats)]
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(args.cpu), *cmd]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = LINE.search(text)
    if m is None:
        raise SystemExit(f"driver said: {text.strip()}")
    return float(m[1]), float(m[2]), f"{m[3]} {m[4]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True,
                    help="git revision whose kernels are the baseline, or a copy of that file "
                         "(a machine whose clone lacks the revision)")  # fmt: skip
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=None, help="core to pin the drivers to (taskset)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    compiler = find_compiler()
    if compiler is None or not qn.available():
        raise SystemExit("no C++ compiler on PATH, or the kernels do not build here")
    base_src = base_source(args.base)
    with tempfile.TemporaryDirectory() as tmp:
        exes = {
            "base": build(base_src, Path(tmp) / "base", compiler),
            "tree": build((ROOT / SOURCE).read_text(), Path(tmp) / "tree", compiler),
        }
        rows: list[dict[str, Any]] = []
        for isa in range(qn.best_isa(), 0, -1):
            best: dict[str, list[float]] = {k: [1e9, 1e9] for k in exes}
            digests: set[str] = set()
            for _ in range(args.rounds):
                for name, exe in exes.items():
                    awq, nvfp4, digest = run(exe, args, isa)
                    best[name] = [min(best[name][0], awq), min(best[name][1], nvfp4)]
                    digests.add(digest)
            if len(digests) != 1:
                raise SystemExit(f"isa {isa}: the two kernels' bytes differ: {sorted(digests)}")
            row = {"isa": isa, **{f"{k}_ms": v for k, v in best.items()}}
            row["awq_base_over_tree"] = best["base"][0] / best["tree"][0]
            row["nvfp4_base_over_tree"] = best["base"][1] / best["tree"][1]
            row["nvfp4_over_awq_tree"] = best["tree"][1] / best["tree"][0]
            rows.append(row)
            print(f"path {isa}: awq {best['base'][0]:.2f} -> {best['tree'][0]:.2f} ms "
                  f"({row['awq_base_over_tree']:.2f}x)  nvfp4 tiled {best['base'][1]:.2f} -> "
                  f"{best['tree'][1]:.2f} ms ({row['nvfp4_base_over_tree']:.2f}x)  "
                  f"nvfp4/awq {row['nvfp4_over_awq_tree']:.2f}  bytes equal")  # fmt: skip
    doc = {
        "benchmark": "bench_quant_kernels_ab",
        "machine": machine_info(),
        "base": args.base,
        "base_sha256": hashlib.sha256(base_src.encode()).hexdigest(),
        "tree_sha256": hashlib.sha256((ROOT / SOURCE).read_bytes()).hexdigest(),
        "shape": [args.rows, args.cols],
        "unit": "ms, best of repeats and rounds, one pinned thread; [awq g128, nvfp4 tiled]",
        "paths": rows,
    }
    if args.json:
        write_result(args.json, doc)


if __name__ == "__main__":
    main()
