"""Where one routed expert's AWQ unit spends its time on a GPU (issue #16, calibration at scale).

One DeepSeek-V3 routed expert at real shapes (gate/up [I, H], down [H, I]; defaults H 7168, I 2048)
and its routed tokens (default 2,048, as 671B's 128 × 512 calibration tokens give per expert),
random BF16: times the calls ``calib/layer.py`` makes for it — the shared gate/up scale search
(here over this expert alone), the up → down search, the three clip searches — each synchronized,
medians of ``--repeats``; then a ``torch.profiler`` table of one more unit (top ops by device and
by host time). Usage (hetquant importable): ``python benchmarks/archive/probes/awq_expert_profile.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hetquant.calib import awq
from hetquant.calib.quantizer import quantizer_for


def unit(w_gate, w_up, w_down, x, g, *, clip: bool = True) -> dict[str, float]:
    dev = x.device
    q = quantizer_for("awq_w4a16", {"group_size": g})  # the awq-w4a16 recipe's Q
    times: dict[str, float] = {}

    def timed(name, fn):
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        times[name] = time.perf_counter() - t0
        return out

    timed(
        "scale gate/up", lambda: awq.search_scale([w_gate, w_up], x, [q, q], matmul_dtype=x.dtype)
    )
    h = (F.silu(x @ w_gate.T) * (x @ w_up.T)).to(x.dtype)  # [T, I]
    timed("scale down", lambda: awq.search_scale([w_down], h, [q], matmul_dtype=x.dtype))
    if clip:
        timed("clip gate", lambda: awq.search_clip(w_gate, x, q))
        timed("clip up", lambda: awq.search_clip(w_up, x, q))
        timed("clip down", lambda: awq.search_clip(w_down, h, q))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    dev = torch.device(a.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    bf = torch.bfloat16
    w_gate = (torch.randn(a.inter, a.hidden, generator=gen) * 0.02).to(bf).to(dev)
    w_up = (torch.randn(a.inter, a.hidden, generator=gen) * 0.02).to(bf).to(dev)
    w_down = (torch.randn(a.hidden, a.inter, generator=gen) * 0.02).to(bf).to(dev)
    x = torch.randn(a.tokens, a.hidden, generator=gen).to(bf).to(dev)
    unit(w_gate, w_up, w_down, x, a.group)  # warm-up
    runs = [unit(w_gate, w_up, w_down, x, a.group) for _ in range(a.repeats)]
    total = [sum(r.values()) for r in runs]
    print(f"device {dev} · H {a.hidden} I {a.inter} T {a.tokens} g {a.group}")
    for k in runs[0]:
        print(f"  {k:14s} {statistics.median(r[k] for r in runs) * 1e3:8.1f} ms")
    print(f"  {'unit':14s} {statistics.median(total) * 1e3:8.1f} ms")
    if a.no_profile:
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        unit(w_gate, w_up, w_down, x, a.group)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
