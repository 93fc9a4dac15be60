"""Our kt exports, loaded into kt-kernel itself: its MoE output against our CpuExpertPool's.

For each case a synthetic hybrid artifact (``_kt.make_hybrid``: DeepSeek shapes by default, random
codes and scales) is exported with ``hetquant export`` and loaded into kt-kernel 0.7.2 — AMXINT4
from the ``.kt`` tree (per-channel experts; needs kt's AVX-512 variants), RAWINT4 from the
compressed-tensors files (group-32 experts; AVX2 works) — and both systems run the same tokens
and routings. Each output is compared with the float64 MoE over the exactly dequantized weights
(relative Frobenius error), as reference/cpu_experts.md §7.3 did. kt quantizes activations to
int8 per token (also ``silu(gate)·up`` before down), so its error is that of W4A8; ours is
exact to the bf16 rounding of the result. The check fails (exit 1) when kt's error exceeds
``--max-kt-err`` (0.06: about twice §7.3's 3.5e-2 – 3.7e-2) or ours exceeds ``--max-ours-err``
(4e-3: bf16 output rounding is ≤ 2^-9 relative per element) — a wrong byte in the export (a
transposed tile, a swapped nibble, a scale off by 16) gives errors of order 1.

Run it in kt-kernel's environment, not hetquant's (see ``benchmarks/notes/kt-kernel.md``)::

    python benchmarks/kt_check.py [--experts 16] [--tokens 8] [--numa 1 2] [--cases amxint4 rawint4]

(RAWINT4 runs with one thread pool only: kt-kernel 0.7.2 refuses more in its pointer mode.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kt

HERE = Path(__file__).resolve().parent
CASES = {"amxint4": ("kt-amxint4", "AMXINT4", 0), "rawint4": ("kt-rawint4", "RAWINT4", 32)}


def run_case(args: argparse.Namespace, work: Path, case: str, numa: int) -> dict:
    from hetquant.runtime.experts.expert_pool import CpuExpertPool

    to, method, group = CASES[case]
    e, h, i = args.experts, args.hidden, args.inter
    t0 = time.perf_counter()
    art = _kt.make_hybrid(work, e, h, i, group, seed=args.seed)
    out = _kt.export(art, to, numa)
    prep = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed + 1)
    x = (torch.randn(args.tokens, h, generator=g) * 0.5).to(torch.bfloat16)
    ids, w = _kt.routing(args.tokens, e, args.topk, args.seed + 2)
    kt = _kt.KtMoE(out, method, e, args.topk, h, i, args.threads, numa)
    y_kt = kt.forward(x, ids, w)
    with CpuExpertPool.open(art, subpools=numa) as pool:
        y_ours = pool.forward(_kt.LAYER, x, ids, w)
    ref = _kt.reference(art, x, ids, w)
    row = {
        "case": case, "export": to, "method": method, "kt_backend": kt.backend, "numa": numa,
        "experts": e, "hidden": h, "inter": i, "group": group, "tokens": args.tokens,
        "topk": args.topk, "prepare_s": round(prep, 1),
        "err_kt": _kt.rel_err(y_kt, ref), "err_ours": _kt.rel_err(y_ours, ref),
        "kt_vs_ours": _kt.rel_err(y_kt, y_ours.to(torch.float64)),
        "finite": bool(torch.isfinite(y_kt.float()).all()),
    }  # fmt: skip
    row["ok"] = row["finite"] and row["err_kt"] <= args.max_kt_err and row["err_ours"] <= args.max_ours_err  # fmt: skip
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--numa", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kt-err", type=float, default=0.06)
    ap.add_argument("--max-ours-err", type=float, default=4e-3)
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the exports")
    ap.add_argument("--json", default=str(HERE / "results" / "kt_check.json"))
    args = ap.parse_args()
    _kt.import_hetquant()
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="hetquant-kt-"))
    env = _kt.environment()
    print(f"kt-kernel {env['kt_kernel']} ({env['kt_variant']}), torch {env['torch']}")
    rows = []
    for case in args.cases:
        for numa in args.numa if case != "rawint4" else [1]:  # kt runs RAWINT4 on 1 pool only
            try:
                row = run_case(args, work, case, numa)
            except RuntimeError as err:  # e.g. no AMXInt4_MOE in kt's AVX2 build
                row = {"case": case, "numa": numa, "skipped": str(err).splitlines()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")
    ran = [r for r in rows if "skipped" not in r]
    return 0 if ran and all(r["ok"] for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
