"""Golden sha256 of every file of every recipe's artifact on the embedded tiny model.

``python tests/convert/golden_artifacts.py`` converts ``examples/tiny-deepseek-v3`` with each
entry of ``CASES`` and writes ``golden_artifacts.json`` beside this file: per case, the sha256 of
every file but the manifest, and the manifest itself less the checkout-dependent ``source.path``.
The test (``test_golden_artifacts.py``) converts again and requires the same bytes; a manifest may
gain fields, never change the recorded ones. Regenerate only for a change that means to alter
artifacts, and say so in its commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-deepseek-v3"
GOLDEN = Path(__file__).with_name("golden_artifacts.json")
MANIFEST = "hetquant.json"

CASES: dict[str, list[str]] = {
    "bf16": ["--recipe", "bf16"],
    "bf16-1mb-shards": ["--recipe", "bf16", "--max-shard-size", "1MB"],
    "ascend-hybrid": ["--recipe", "ascend-hybrid"],
    "ascend-hybrid-mtp-drop": ["--recipe", "ascend-hybrid", "--mtp", "drop"],
    "ascend-w8a8": ["--recipe", "ascend-w8a8"],
    "awq-w4a16": ["--recipe", "awq-w4a16"],
    "awq-w4a16-g64": ["--recipe", "awq-w4a16", "--group-size", "64"],
    "awq-w4a16-calibrated": [
        "--recipe", "awq-w4a16", "--calib-data", "examples/tiny-tools/calib.txt",
        "--calib-samples", "4", "--calib-seq-len", "64",
    ],
    "fp4": ["--recipe", "fp4"],
    "fp4-nvfp4": ["--recipe", "fp4", "--fp4-layout", "nvfp4"],
    "ascend-w4a8": ["--recipe", "ascend-w4a8"],
    "ascend-w4a16": ["--recipe", "ascend-w4a16"],
    "ascend-w4a16-g128": ["--recipe", "ascend-w4a16", "--group-size", "128"],
    "ascend-w4a8-calibrated": [
        "--recipe", "ascend-w4a8", "--calib-data", "examples/tiny-tools/calib.txt",
        "--calib-samples", "4", "--calib-seq-len", "64",
    ],
    "ascend-w4a16-calibrated": [
        "--recipe", "ascend-w4a16", "--calib-data", "examples/tiny-tools/calib.txt",
        "--calib-samples", "4", "--calib-seq-len", "64",
    ],
    "ct-w4a16": ["--recipe", "ct-w4a16"],
    "ct-w4a16-calibrated": [
        "--recipe", "ct-w4a16", "--calib-data", "examples/tiny-tools/calib.txt",
        "--calib-samples", "4", "--calib-seq-len", "64",
    ],
    "ascend-hybrid-calibrated-gptq": [
        "--recipe", "ascend-hybrid", "--calib-data", "examples/tiny-tools/calib.txt",
        "--calib-samples", "4", "--calib-seq-len", "64", "--calib-gptq",
    ],
}  # fmt: skip
CALIBRATED = tuple(case for case, args in CASES.items() if "--calib-data" in args)


def manifest_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The manifest without what depends on where the source lies."""
    doc = json.loads(json.dumps(doc))
    doc.get("source", {}).pop("path", None)
    return doc


def artifact_digest(out: Path) -> dict[str, Any]:
    files = {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = json.loads((out / MANIFEST).read_text())
    return {"files": files, "manifest": manifest_fields(manifest)}


def _abs(arg: str) -> str:
    """Repository-relative paths in CASES, made absolute (the golden list holds no checkout)."""
    return str(REPO / arg) if arg.startswith("examples/") else arg


def convert(case: str, out: Path) -> dict[str, Any]:
    from click.testing import CliRunner

    from hetquant.convert.cli import main

    args = ["convert", str(TINY), str(out), *(_abs(a) for a in CASES[case])]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"{case}: exit {result.exit_code}: {result.output}")
    return artifact_digest(out)


def main() -> None:
    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            golden[case] = {"args": CASES[case], **convert(case, Path(tmp) / case)}
            print(case, len(golden[case]["files"]), "files", file=sys.stderr)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
