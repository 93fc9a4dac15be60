"""Calibrated artifacts across machines and devices (issue #25 §0).

For every calibrated case of the golden list (``tests/convert/golden_artifacts.py``):

1. convert with ``--calib-device cpu`` (float64, ``calib/awq.py`` "Reproducibility") and compare
   every file's sha256 with the golden list, which was made on another machine — the run's CPU
   model, torch version and ATen capability are printed beside the answer;
2. where CUDA is present, convert with ``--calib-device cuda`` (BF16 matmuls) and measure how far
   it lands from the CPU's artifact: per stored tensor, the fraction of elements that differ,
   summed over the quantized weights (codes) and over their scales.

Prints one JSON document (``--out`` also writes it); timings are not the point here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "convert"))

import golden_artifacts as golden  # noqa: E402
from _measure import machine_info  # noqa: E402


def _convert(case: str, out: Path, device: str) -> dict:
    golden.CASES[f"{case}@{device}"] = [*golden.CASES[case], "--calib-device", device]
    return golden.convert(f"{case}@{device}", out)


def _tensor_diff(a: Path, b: Path) -> dict[str, list[int]]:
    """Per tensor-name suffix: [elements differing, elements] between two safetensors files."""
    out: dict[str, list[int]] = {}
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        for name in fa.keys():
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            row = out.setdefault(name.rsplit(".", 1)[-1], [0, 0])
            row[1] += x.numel()
            if x.shape != y.shape or x.dtype != y.dtype:
                row[0] += x.numel()
            elif x.numel():
                bx = x.contiguous().reshape(-1).view(torch.uint8).reshape(x.numel(), -1)
                by = y.contiguous().reshape(-1).view(torch.uint8).reshape(x.numel(), -1)
                row[0] += int((bx != by).any(-1).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    doc = json.loads(golden.GOLDEN.read_text())
    report: dict = {
        "cpu": machine_info()["cpu_model"],
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for case in golden.CALIBRATED:
            cpu = _convert(case, Path(tmp) / f"{case}-cpu", "cpu")
            want = doc[case]["files"]
            row = {
                "cpu_equals_golden": cpu["files"] == want,
                "cpu_files_differing": sorted(k for k in want if cpu["files"].get(k) != want[k]),
            }
            if torch.cuda.is_available():
                gpu = _convert(case, Path(tmp) / f"{case}-cuda", "cuda")
                row["cuda_files_differing"] = sorted(
                    k for k in want if gpu["files"].get(k) != cpu["files"].get(k)
                )
                diff: dict[str, list[int]] = {}
                for name in row["cuda_files_differing"]:
                    if name.endswith(".safetensors"):
                        for kind, (d, n) in _tensor_diff(
                            Path(tmp) / f"{case}-cpu" / name, Path(tmp) / f"{case}-cuda" / name
                        ).items():
                            acc = diff.setdefault(kind, [0, 0])
                            acc[0] += d
                            acc[1] += n
                row["cuda_vs_cpu_elements_differing"] = {
                    k: {"differ": d, "of": n, "fraction": round(d / max(n, 1), 5)}
                    for k, (d, n) in sorted(diff.items())
                }
            report["cases"][case] = row
            print(case, json.dumps(row), file=sys.stderr)
    text = json.dumps(report, indent=1, sort_keys=True)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
