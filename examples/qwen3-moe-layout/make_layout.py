"""Write the layout of a real Qwen3-MoE checkpoint (Qwen3-235B-A22B, Qwen3-30B-A3B; their BF16 or
-FP8 repos), with no data.

Every tensor name, dtype and shape (from the published ``config.json`` beside this file, through
hetquant's Qwen3-MoE role table), split over shards of about 4 GB named as Qwen names them
(``model-%05d-of-%05d.safetensors``), plus ``model.safetensors.index.json``. Each shard holds a
real header; its data is a sparse hole, so the 470 GB layout costs a few MB of disk. Anything
that reads only headers (``hetquant convert --dry-run``, ``inspect``, the planner) runs on it as
on the real thing.

What is from the published files and what is not: the config keys and values follow
reference/model_families.md §2.1 (``intermediate_size`` and the 235B's bos/eos ids, which no
tensor depends on, are as Qwen's configs are remembered, not re-read). ``--dtype fp8`` adds the
-FP8 repos' ``quantization_config`` (128×128 blocks, §2.3) and stores every linear but the router
as E4M3 with a ``weight_scale_inv`` partner — F32 here, as DeepSeek's: the real Qwen3-FP8 scale
dtype is UNVERIFIED (§8); the plan does not depend on it. Shard counts follow ~4 GB shards, not
the real index.

    python examples/qwen3-moe-layout/make_layout.py OUT_DIR --model Qwen3-235B-A22B [--dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hetquant.formats import TensorMeta
from hetquant.formats.families import SCALE_SUFFIX, ModelConfig, expected_tensors
from hetquant.formats.fp8_block import scale_shape
from hetquant.formats.safetensors_io import build_header, create_file

HERE = Path(__file__).resolve().parent
MODELS = ("Qwen3-235B-A22B", "Qwen3-30B-A3B")
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}  # fmt: skip
SHARD_BYTES = 4 * 10**9
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"


def source_tensors(cfg: ModelConfig, dtype: str) -> list[tuple[str, TensorMeta]]:
    """(name, meta) of every stored tensor in model order, FP8 scales after their weights."""
    out = []
    for name, tr in expected_tensors(cfg).items():
        if dtype == "fp8" and tr.role.kind == "linear":
            out.append((name, TensorMeta("F8_E4M3", tr.shape)))
            out.append((name + SCALE_SUFFIX, TensorMeta("F32", scale_shape(tr.shape, 128))))  # type: ignore[arg-type]
        else:
            out.append((name, TensorMeta("BF16", tr.shape)))
    return out


def write_layout(out: Path, model: str = MODELS[0], dtype: str = "bf16") -> Path:
    """Write the layout of ``model`` (``dtype``: bf16 or fp8) into ``out``; returns ``out``."""
    raw = json.loads((HERE / f"{model}.config.json").read_text())
    if dtype == "fp8":
        raw["quantization_config"] = FP8_CONFIG
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = source_tensors(ModelConfig.from_dict(raw), dtype)
    total = sum(m.nbytes for _, m in tensors)
    n = math.ceil(total / SHARD_BYTES)
    shards: list[list[tuple[str, TensorMeta]]] = [[] for _ in range(n)]
    done = 0
    for name, meta in tensors:
        shards[min(n - 1, done * n // total)].append((name, meta))
        done += meta.nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = SHARD_NAME.format(i + 1, n)
        create_file(
            out / fname, build_header(shard, {"format": "pt"}), sum(m.nbytes for _, m in shard)
        )
        weight_map |= {k: fname for k, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=MODELS, default=MODELS[0])
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = ap.parse_args()
    write_layout(args.out, args.model, args.dtype)


if __name__ == "__main__":
    main()
