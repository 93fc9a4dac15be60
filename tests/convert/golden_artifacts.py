"""Golden sha256 of every file of every recipe's artifact on the embedded tiny model, and on the
tiny vision-language models the examples generate.

``python tests/convert/golden_artifacts.py [CASE ...]`` converts each entry of ``CASES`` (only
the named ones, the others kept as recorded) and writes ``golden_artifacts.json`` beside this
file: per case, the sha256 of every file but the manifest, and the manifest itself less the
checkout-dependent ``source.path``. A case's source is ``examples/tiny-deepseek-v3`` unless
``CASE_SOURCES`` names a generated one (``GENERATED``: the tiny Qwen3-VL-MoE, BF16 with fused
experts or FP8 per expert, and the tiny Kimi K2.5, written by their ``make_tiny.py``); its entry
then also records ``source`` and the sha256 of every file the generator wrote
(``source_files``), so a changed generator is told apart from a changed converter. The test
(``test_golden_artifacts.py``) converts again and requires the same bytes; a manifest may gain
fields, never change the recorded ones. Regenerate only for a change that means to alter
artifacts, only the cases it alters, and say so in its commit.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import sys
import tempfile
from collections.abc import Callable
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
    # vision-language models (issue #28): bf16 and one quantized recipe each, the processor
    # files travelling; --quantize-vision writes the vision linears engines read quantized
    "qwen3-vl-moe-bf16": ["--recipe", "bf16"],
    "qwen3-vl-moe-ascend-w8a8-vision": ["--recipe", "ascend-w8a8", "--quantize-vision"],
    "qwen3-vl-moe-fp8-ascend-hybrid": ["--recipe", "ascend-hybrid"],
    "kimi-k25-bf16": ["--recipe", "bf16"],
    "kimi-k25-ascend-w4a16-vision": ["--recipe", "ascend-w4a16", "--quantize-vision"],
}  # fmt: skip
CALIBRATED = tuple(case for case, args in CASES.items() if "--calib-data" in args)


def _example(rel: str) -> Any:
    return runpy.run_path(str(REPO / "examples" / rel / "make_tiny.py"))


# generated source → writer of it into a directory (returns the checkpoint directory)
GENERATED: dict[str, Callable[[Path], Path]] = {
    "tiny-qwen3-vl-moe-bf16": lambda d: _example("tiny-qwen3-vl-moe")["write_checkpoint"](d, "bf16"),
    "tiny-qwen3-vl-moe-fp8": lambda d: _example("tiny-qwen3-vl-moe")["write_checkpoint"](d, "fp8"),
    "tiny-kimi-k25": lambda d: _example("kimi-k25")["write_checkpoint"](d),
}  # fmt: skip
CASE_SOURCES: dict[str, str] = {
    "qwen3-vl-moe-bf16": "tiny-qwen3-vl-moe-bf16",
    "qwen3-vl-moe-ascend-w8a8-vision": "tiny-qwen3-vl-moe-bf16",
    "qwen3-vl-moe-fp8-ascend-hybrid": "tiny-qwen3-vl-moe-fp8",
    "kimi-k25-bf16": "tiny-kimi-k25",
    "kimi-k25-ascend-w4a16-vision": "tiny-kimi-k25",
}


def manifest_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The manifest without what depends on where the source lies."""
    doc = json.loads(json.dumps(doc))
    doc.get("source", {}).pop("path", None)
    return doc


def file_digests(root: Path, skip: str = MANIFEST) -> dict[str, str]:
    """sha256 of every file under ``root`` but ``skip``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != skip
    }


def artifact_digest(out: Path) -> dict[str, Any]:
    manifest = json.loads((out / MANIFEST).read_text())
    return {"files": file_digests(out), "manifest": manifest_fields(manifest)}


def source_of(case: str, scratch: Path) -> tuple[Path, dict[str, Any]]:
    """The source directory of ``case`` (a generated one written under ``scratch``, once per
    ``scratch``), and what its golden entry records of it."""
    name = CASE_SOURCES.get(case)
    if name is None:
        return TINY, {}
    root = scratch / name
    if not root.exists():
        GENERATED[name](root)
    return root, {"source": name, "source_files": file_digests(root, skip="")}


def _abs(arg: str) -> str:
    """Repository-relative paths in CASES, made absolute (the golden list holds no checkout)."""
    return str(REPO / arg) if arg.startswith("examples/") else arg


def convert(case: str, out: Path, scratch: Path | None = None) -> dict[str, Any]:
    """Convert ``case`` into ``out`` (a generated source written under ``scratch``, default
    beside ``out``); its digest, with what it records of a generated source."""
    from click.testing import CliRunner

    from hetquant.convert.cli import main

    src, recorded = source_of(case, scratch or out.parent)
    args = ["convert", str(src), str(out), *(_abs(a) for a in CASES[case])]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"{case}: exit {result.exit_code}: {result.output}")
    return {**recorded, **artifact_digest(out)}


def main(only: list[str]) -> None:
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; CASES has {sorted(CASES)}")
    golden = json.loads(GOLDEN.read_text()) if only and GOLDEN.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in only or CASES:
            golden[case] = {"args": CASES[case], **convert(case, Path(tmp) / case)}
            print(case, len(golden[case]["files"]), "files", file=sys.stderr)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
