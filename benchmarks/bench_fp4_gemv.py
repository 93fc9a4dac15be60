"""CPU FP4 expert GEMV (DeepSeek-V4's experts, ``fp4_cpu_experts``): the native kernel against its
torch reference and against the INT4 kernels on the same shapes, in one run.

Per DeepSeek expert shape — gate_up ``[2·2048, 7168]`` and down ``[7168, 2048]`` — and batch
(``--batches``, default 1, 8 and 64), with 1 thread and with all of torch's threads:

- ``fp4 native``: ``runtime.kernels.fp4_gemv`` native kernel (this CPU's best path);
- ``fp4 torch``: ``backend="torch"``, the reference ``fp4_gemv_int8`` (``--skip-slow`` skips it);
- ``int4 native``: ``int4_gemv`` per-channel (``int4_cpu``), and ``int4 g32`` with BF16 scales per
  32 (``int4_cpu_group``: the same scale granularity as FP4), precision ``high``.

Repeats are interleaved (every kernel once per repeat, in alternating order) and the medians
reported, with each kernel's time as a ratio of ``fp4 native``'s in the same run. Every matrix is
cycled through ``--set-mb`` MB of distinct copies so that weights stream from DRAM as in serving.
GB/s counts the weight bytes a call reads: FP4 ``N·K/2 + N·K/32``; INT4 ``N·K/2 + 4N``; g32
``N·K/2 + 2·N·K/32``.

Usage::

    python benchmarks/bench_fp4_gemv.py                 # JSON + the table in notes/expert-gemv.md
    python benchmarks/bench_fp4_gemv.py --repeats 3 --no-readme
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _measure import machine_info, median, replace_marked, write_result  # noqa: E402

START = "<!-- bench_fp4_gemv:results:start -->"
END = "<!-- bench_fp4_gemv:results:end -->"
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--set-mb", type=int, default=256, help="MB of distinct weight copies")
    ap.add_argument("--skip-slow", action="store_true", help="skip the torch reference")
    ap.add_argument("--json", default=str(HERE / "results" / "bench_fp4_gemv.json"))
    ap.add_argument("--readme", default=str(HERE / "notes" / "expert-gemv.md"))
    ap.add_argument("--no-readme", action="store_true")
    return ap.parse_args()


def make_weights(args: argparse.Namespace, g: Any) -> dict[str, dict[str, Any]]:
    """Per shape: random FP4 codes with UE8M0 scales, INT4 scales (per-channel and per 32) for
    the same codes, in enough distinct copies to fill ``--set-mb``."""
    import torch

    data = {}
    for name, (n, k) in SHAPES.items():
        copies = max(4, args.set_mb * (1 << 20) // (n * k // 2))
        packed = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)]
        packed += [packed[0].clone() for _ in range(copies - 1)]
        e8 = [
            torch.randint(110, 125, (n, k // 32), dtype=torch.uint8, generator=g)
            for _ in range(copies)
        ]
        data[name] = {
            "n": n,
            "k": k,
            "packed": packed,
            "fp4_scale": [e.view(torch.float8_e8m0fnu) for e in e8],
            "int4_scale": [torch.rand(n, generator=g) * 0.01 + 1e-4 for _ in range(copies)],
            "g32_scale": [
                (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).bfloat16()
                for _ in range(copies)
            ],
            "bytes": {
                "fp4": n * k // 2 + n * k // 32,
                "int4": n * k // 2 + 4 * n,
                "int4_g32": n * k // 2 + 2 * n * k // 32,
            },
        }
        print(f"{name} [{n}, {k}]: {copies} copies")
    return data


def kernels(d: dict[str, Any], slow: bool) -> dict[str, tuple[str, Any]]:
    """name → (bytes key, fn(i, x, threads)) for the kernels compared."""
    from hetquant.runtime.kernels.fp4_gemv import fp4_gemv
    from hetquant.runtime.kernels.int4_gemv import int4_gemv

    p = d["packed"]
    out = {
        "fp4_native": (
            "fp4",
            lambda i, x, th: fp4_gemv(p[i], d["fp4_scale"][i], x, backend="native", threads=th),
        ),
        "int4_native": (
            "int4",
            lambda i, x, th: int4_gemv(p[i], d["int4_scale"][i], x, backend="native", threads=th),
        ),
        "int4_g32_native": (
            "int4_g32",
            lambda i, x, th: int4_gemv(p[i], d["g32_scale"][i], x, backend="native", threads=th),
        ),
    }
    if slow:
        out["fp4_torch"] = (
            "fp4",
            lambda i, x, th: fp4_gemv(p[i], d["fp4_scale"][i], x, backend="torch"),
        )
    return out


def measure(args: argparse.Namespace, data: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(2)
    nthreads = torch.get_num_threads()
    samples: dict[str, list[float]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for rep in range(args.repeats):
        for name, d in data.items():
            for t in args.batches:
                x = torch.randn(t, d["k"], generator=g)
                ks = list(kernels(d, not args.skip_slow).items())
                for kname, (bkey, fn) in ks if rep % 2 == 0 else ks[::-1]:
                    for th in sorted({1, nthreads}):
                        copies = len(d["packed"])
                        if kname == "fp4_torch":
                            copies = min(copies, 2 if t >= 8 else 4)  # seconds per call
                        fn(0, x, th)  # warm (first call builds the kernel)
                        t0 = time.perf_counter()
                        for i in range(copies):
                            fn(i, x, th)
                        key = f"{name}/T{t}/{kname}/{th}t"
                        samples.setdefault(key, []).append((time.perf_counter() - t0) / copies)
                        meta[key] = {"bytes": d["bytes"][bkey]}
        print(f"repeat {rep + 1}/{args.repeats} done")
    res = {}
    for key, v in samples.items():
        ms = median(v) * 1e3
        res[key] = {
            "ms": ms,
            "gbps": meta[key]["bytes"] / ms / 1e6,
            "samples_ms": [round(s * 1e3, 4) for s in v],
        }
    for key, r in res.items():
        shape, t, _, th = key.split("/")
        r["x_fp4_native"] = r["ms"] / res[f"{shape}/{t}/fp4_native/{th}"]["ms"]
    return {"threads": nthreads, "results": res}


def table(out: dict[str, Any], args: argparse.Namespace) -> str:
    res, nthreads = out["results"], out["threads"]
    names = ["fp4_native", "fp4_torch", "int4_native", "int4_g32_native"]
    rows = [
        "| shape | T | threads | " + " | ".join(names) + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for shape in SHAPES:
        for t in args.batches:
            for th in sorted({1, nthreads}):
                cells = []
                for k in names:
                    r = res.get(f"{shape}/T{t}/{k}/{th}t")
                    cells.append(
                        "—"
                        if r is None
                        else f"{r['ms']:.3g} ms ({r['gbps']:.1f} GB/s, {r['x_fp4_native']:.2f}×)"
                    )
                rows.append(f"| {shape} | {t} | {th} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    import torch

    from hetquant.runtime.kernels import int4_gemv as G

    info = G.native_info()
    if not info["available"]:
        sys.exit(f"native kernel unavailable: {info['error']}")
    data = make_weights(args, torch.Generator().manual_seed(1))
    out = measure(args, data)
    doc = {"machine": machine_info(), "isa": info["isa"], "args": vars(args), **out}
    write_result(args.json, doc)
    text = table(out, args)
    print(text)
    if not args.no_readme:
        m = doc["machine"]
        head = (
            f"{m.get('cpu_model', '?')}, {out['threads']} threads, path `{info['isa']}`, "
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC "
            "(ms per call, weight GB/s, time as a multiple of fp4_native's):"
        )
        replace_marked(Path(args.readme), START, END, head + "\n\n" + text)


if __name__ == "__main__":
    main()
