"""A/B of the grouped INT4 GEMV: a baseline tree's grouped kernel against this tree's, with the
per-channel kernel as the yardstick, in one process (``gemv_group_ab.cpp``).

Both trees' kernel translation units (``int4_gemv_native._CPP_PARTS``) are compiled as the runtime
compiles them (``formats.native.DEFAULT_FLAGS``, without ``-shared -fPIC``), their C entry points
renamed, and linked into one driver. For each configuration (shape, working set, tokens,
precision, instruction path; one thread) the three kernels run interleaved, repeat by repeat,
and the driver checks that both grouped kernels give the same bits. Reported per kernel: weight
GB/s by the calling thread's CPU time (median; immune to waiting for a CPU on a shared machine),
and for each grouped kernel its ratio to the per-channel kernel (median of per-repeat ratios,
weight bytes: ``N·K/2 + 2·N·K/32`` grouped, ``N·K/2 + 4N`` per-channel) — the measure of issue
#12's target (≥ 0.9). Working sets: ``l1`` (row stride 0: every row reads the same bytes, pure
arithmetic), ``cache`` (one matrix, again and again), ``dram`` (copies cycled through 256 MB).

Usage::

    python benchmarks/archive/probes/gemv_group_ab.py [--baseline c3184d8 | --baseline-dir DIR]
        [--repeats 9] [--json benchmarks/results/gemv_group_ab.json]

``--baseline-dir`` names a directory holding the baseline's four ``int4_gemv*.cpp`` parts (for
a host without the git history); by default they come from ``git show BASELINE:...``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE.parents[1]))

from _measure import machine_info, write_result  # noqa: E402

PARTS = ("int4_gemv_base.cpp", "int4_gemv_x86.cpp", "int4_gemv_neon.cpp", "int4_gemv.cpp")
FLAGS = ("-O3", "-std=c++17", "-fno-math-errno")  # formats/native.py DEFAULT_FLAGS, as a program
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
ISAS = {2: "avx2", 3: "avx512_vnni"}


def baseline_source(commit: str | None, directory: str | None) -> str:
    if directory:
        return "\n".join((Path(directory) / p).read_text(encoding="utf-8") for p in PARTS)
    return "\n".join(
        subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:runtime/kernels/{p}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for p in PARTS
    )


def build(work: Path, old_src: str) -> Path:
    new_src = "\n".join(
        (REPO / "runtime" / "kernels" / p).read_text(encoding="utf-8") for p in PARTS
    )
    cxx = shutil.which("g++") or "c++"
    objs = []
    for tag, src in (("old", old_src), ("new", new_src)):
        cpp = work / f"{tag}.cpp"
        cpp.write_text(src, encoding="utf-8")
        ren = [
            f"-Dhq_int4_gemv_grouped={tag}_g",
            f"-Dhq_int4_gemv={tag}_pc",
            f"-Dhq_int4_best_isa={tag}_best",
            f"-Dhq_int4_token_block={tag}_tb",
        ]
        obj = work / f"{tag}.o"
        subprocess.run([cxx, *FLAGS, *ren, "-c", str(cpp), "-o", str(obj)], check=True)
        objs.append(str(obj))
    exe = work / "ab"
    subprocess.run(
        [cxx, "-O2", str(HERE / "gemv_group_ab.cpp"), *objs, "-o", str(exe), "-lpthread"],
        check=True,
    )
    return exe


def isas_here() -> list[int]:
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    have = [2] if " avx2" in flags else []
    if " avx512_vnni" in flags and " avx512bw" in flags:
        have.append(3)
    return have


def ratios(res: dict, kind: str, clock: str) -> float:
    g, pc = res[kind][clock], res["per_channel"][clock]
    bg, bpc = res["bytes"]["group"], res["bytes"]["per_channel"]
    return statistics.median((bg / a) / (bpc / b) for a, b in zip(g, pc, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="c3184d8")
    ap.add_argument("--baseline-dir", default=None)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--modes", nargs="+", default=["l1", "cache", "dram"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument(
        "--isas", nargs="+", default=None, help="avx2 / avx512_vnni (default: all here)"
    )
    ap.add_argument("--json", default=str(HERE.parent / "results" / "gemv_group_ab.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hq-gemv-ab-") as tmp:
        exe = build(Path(tmp), baseline_source(args.baseline, args.baseline_dir))
        codes = {v: c for c, v in ISAS.items()}
        for isa in [codes[i] for i in args.isas] if args.isas else isas_here():
            for shape, (n, k) in SHAPES.items():
                for mode in args.modes:
                    for t in args.batches:
                        for prec, planes in (("high", 3), ("fast", 2)):
                            cmd = [str(exe), str(n), str(k), mode, str(t), str(planes)]
                            cmd += ["32", str(isa), "1", str(args.repeats)]
                            out = subprocess.run(cmd, capture_output=True, text=True)
                            if out.returncode != 0:  # 1: the two grouped kernels' bits differ
                                raise SystemExit(f"{cmd}: exit {out.returncode}\n{out.stdout}")
                            res = json.loads(out.stdout)
                            row = {"isa": ISAS[isa], "shape": shape, "mode": mode, "batch": t}
                            row.update(precision=prec, raw=res)
                            for kind in ("per_channel", "group_old", "group_new"):
                                key = "per_channel" if kind == "per_channel" else "group"
                                med = statistics.median(res[kind]["cpu_s"])
                                row[f"{kind}_gbps_cpu"] = res["bytes"][key] / med / 1e9
                            for kind in ("group_old", "group_new"):
                                row[f"{kind}_ratio_cpu"] = ratios(res, kind, "cpu_s")
                                row[f"{kind}_ratio_wall"] = ratios(res, kind, "wall_s")
                            rows.append(row)
                            print(table_row(row), flush=True)
    doc = {
        "machine": {**machine_info(), "host": platform.node()},
        "baseline": args.baseline_dir or args.baseline,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_result(args.json, doc)
    print(f"wrote {args.json}")
    return 0


HEADER = (
    "| path | shape | weights | batch | precision | per-channel GB/s | grouped before GB/s | "
    "grouped after GB/s | ratio before | ratio after | after, by wall |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(r: dict) -> str:
    n, k = SHAPES[r["shape"]]
    return (
        f"| {r['isa']} | {r['shape']} [{n}, {k}] | {r['mode']} | {r['batch']} | {r['precision']} "
        f"| {r['per_channel_gbps_cpu']:.2f} | {r['group_old_gbps_cpu']:.2f} | "
        f"{r['group_new_gbps_cpu']:.2f} | {r['group_old_ratio_cpu']:.2f} | "
        f"**{r['group_new_ratio_cpu']:.2f}** | {r['group_new_ratio_wall']:.2f} |"
    )


if __name__ == "__main__":
    print(HEADER)
    sys.exit(main())
