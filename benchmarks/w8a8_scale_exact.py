"""W8A8_DYNAMIC weight dequantization error as vllm-ascend loads it, for three scale choices
(issue #14 item 5).

vllm-ascend 0.23.0.post1 declares ``weight_scale`` in the model dtype (``params_dtype``, BF16 for
DeepSeek: ``quantization/methods/w8a8_dynamic.py:71``, MoE :205-210); the F32 file value is
``copy_``-ed into it, i.e. rounded to the nearest BF16, and the kernel's F32 scale is made from
that (:151, :362). So the weight the NPU computes with is ``q · f32(bf16(weight_scale))``.

For every linear the ``ascend-w8a8`` recipe stores as W8A8_DYNAMIC (exact BF16 source weights):

- ``before``: hetquant until this change: ``s = f32(amax / 127)``, ``q = round(W / s)`` in F32;
  the load rounds ``s`` to BF16, so the codes no longer match the scale used;
- ``after``: hetquant now (``formats/w8a8_npu.py``): ``s`` rounded up to BF16 (held exactly),
  ``q`` the correctly rounded quotient against it;
- ``msmodelslim``: msModelSlim 26.1.0's formula in the model's BF16 arithmetic
  (``ir/api/impl/int_quantization.py:80-83`` scale = bf16(amax / 127) floored at FLT_EPSILON;
  ``:138`` q = round(bf16(W / s) + 0)), which reproduces its output bit for bit
  (reference/ascend_formats.md §C).

Reported per source: mean and max over linears of the relative Frobenius error ‖Ŵ − W‖ / ‖W‖;
the share of elements whose error exceeds half a step of the scale the NPU uses (the bound a
consistent round-to-nearest keeps: ``> s/2`` means a code is off for that scale, or clipped);
and the share of codes that differ from ``after``. Ratios are against ``before``. For reference,
``before_f32``: the old codes with their F32 scale held as F32 (a consumer that keeps F32 scales,
such as hetquant's CPU runtime: what the old artifact was at its best).

    python benchmarks/w8a8_scale_exact.py [SOURCE ...]   # default: both embedded tiny models
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _measure import open_sources

from hetquant.convert import SourceCheckpoint, get_recipe, plan_for
from hetquant.formats import get_format
from hetquant.formats.w8a8_npu import INT8_MAX, INT8_MIN, SCALE_FLOOR

RESULTS = Path(__file__).parent / "results" / "w8a8_scale_exact.json"
DYN = get_format("w8a8_dynamic")
METHODS = ("before", "after", "msmodelslim", "before_f32")


def before(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, F32 scale as written) of the F32 formula hetquant used before."""
    w32 = w.to(torch.float32)
    s = (w32.abs().amax(1, keepdim=True) / INT8_MAX).clamp(min=SCALE_FLOOR)
    return (w32 / s).round_().clamp_(INT8_MIN, INT8_MAX), s


def after(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = DYN.quantize(w)
    return t["weight"].to(torch.float32), t["weight_scale"]


def msmodelslim(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """msModelSlim's symmetric per-channel int8, every step in BF16 (the model's dtype)."""
    wb = w.to(torch.bfloat16)
    eps = torch.tensor([SCALE_FLOOR]).to(torch.bfloat16)
    s = torch.max(wb.abs().amax(1, keepdim=True) / float(INT8_MAX), eps)  # BF16
    q = (wb / s + torch.zeros((), dtype=torch.bfloat16)).round_()  # round(bf16(W / s) + 0)
    return q.clamp_(INT8_MIN, INT8_MAX).to(torch.float32), s.to(torch.float32)


def loaded(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(weight the consumer computes with, its scale): the file scale held in ``dtype``."""
    held = s.to(dtype).to(torch.float32)
    return q * held, held


def measure(src: SourceCheckpoint) -> dict[str, object]:
    plan = plan_for(src, get_recipe("ascend-w8a8"), 1 << 40)
    names = [j.source for j in plan.jobs if j.target.name == "w8a8_dynamic"]
    stats = {m: {"rel": [], "over": 0, "code_diff": 0} for m in METHODS}
    elements = 0
    for name in names:
        w = src.dequantized(name)  # exact BF16
        ref = w.to(torch.float64)
        fns = (before, after, msmodelslim, before)
        codes = {m: fn(w) for m, fn in zip(METHODS, fns, strict=True)}
        elements += w.numel()
        for m, (q, s) in codes.items():
            deq, held = loaded(q, s, torch.float32 if m == "before_f32" else torch.bfloat16)
            err = (deq.double() - ref).abs()
            stats[m]["rel"].append(float(err.norm() / ref.norm()))
            stats[m]["over"] += int((err > held.double() / 2).sum())
            stats[m]["code_diff"] += int((q != codes["after"][0]).sum())
    out: dict[str, object] = {"linears": len(names), "elements": elements}
    for m, st in stats.items():
        rel = st["rel"]
        out[m] = {
            "mean_rel_err": sum(rel) / len(rel),
            "max_rel_err": max(rel),
            "share_over_half_step": st["over"] / elements,
            "share_codes_differ_from_after": st["code_diff"] / elements,
        }
    return out


def main() -> None:
    results = {}
    for s, src in open_sources(__doc__.splitlines()[0]):
        res = measure(src)
        results[s] = res
        base = res["before"]["mean_rel_err"]  # type: ignore[index]
        print(f"{s}: {res['linears']} W8A8_DYNAMIC linears, {res['elements']} weights")
        print("  method        mean rel err  x before  max rel err  > s/2     codes != after")
        for m in METHODS:
            r = res[m]  # type: ignore[index]
            print(
                f"  {m:<12}  {r['mean_rel_err']:.4e}    {r['mean_rel_err'] / base:.3f}   "
                f"{r['max_rel_err']:.4e}   {r['share_over_half_step']:.2%}   "
                f"{r['share_codes_differ_from_after']:.2%}"
            )
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
