"""Write the layout of DeepSeek-V4-Flash or -Pro as DeepSeek ships it, with no data.

Every tensor name, dtype and shape (the config beside this file through hetquant's
``deepseek_v4`` role table; dtypes as ``examples/tiny-deepseek-v4/make_tiny.py`` writes them:
attention linears, the indexer's ``wq_b``, shared experts and MTP ``e_proj`` / ``h_proj`` block
FP8 with UE8M0 ``scale``; routed experts FP4 ``weight`` I8 + ``scale`` F8_E8M0 per 32; compressors,
``weights_proj``, router, embeddings, norms BF16; hyper-connections, ``ape``, sinks, router bias
F32; ``tid2eid`` I32), spread over N shards with real headers and sparse-hole data, as
``examples/deepseek-v3-layout/make_layout.py`` does for V3.

The configs' provenance (``reference`` data, not the published config.json files, which were not
read): V4-Flash — transformers 5.24 ``DeepseekV4Config`` defaults (hidden 4096, 43 layers, 64 heads ×
512, q_lora 1024, o_groups 8 × 1024, 256 experts of 2048, top-6, hc_mult 4, 3 hash layers, 1 MTP
layer; ``configuration_deepseek_v4.py:129-160``); V4-Pro — hidden 7168, 128 heads, o_groups 16
(``modeling_deepseek_v4.py:317-330``), shared expert 3072 (vLLM issue #42384: 3072 / 16 = 192),
and **61 layers, 384 experts, top-6 are UNVERIFIED**: chosen because they give the published ~805
GiB (``reference/sharding_loading.md``); the per-layer attention schedule of both is transformers'
default (two HCA layers, then CSA / HCA alternating), also UNVERIFIED for the real checkpoints.

    python examples/deepseek-v4-layout/make_layout.py OUT_DIR [--model V4-Flash|V4-Pro] [--shards N]
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import shutil
from pathlib import Path

from hetquant.formats import TensorMeta, get_format
from hetquant.formats.families import ModelConfig, expected_tensors
from hetquant.formats.safetensors_io import build_header, create_file

HERE = Path(__file__).resolve().parent
TINY = runpy.run_path(str(HERE.parent / "tiny-deepseek-v4" / "make_tiny.py"))
SHARD_NAME = "model-{:05d}-of-{:06d}.safetensors"


def source_tensors(cfg: ModelConfig) -> list[tuple[str, TensorMeta]]:
    """(name, meta) of every stored tensor in model order, scales after their weights."""
    fp8 = get_format("fp8_block_scale", block=(cfg.weight_block_size or (128, 128))[0])
    fp4 = get_format("fp4_e2m1")
    out = []
    for name, tr in expected_tensors(cfg).items():
        prefix = name.rpartition(".")[0]
        fmt = fp4 if TINY["FP4"].search(name) else fp8 if TINY["FP8"].search(name) else None
        if fmt is not None:
            out.extend((f"{prefix}.{k}", m) for k, m in fmt.stored(tr.shape).items())
        elif name.endswith("tid2eid"):
            out.append((name, TensorMeta("I32", tr.shape)))
        else:
            out.append((name, TensorMeta("F32" if TINY["F32"].search(name) else "BF16", tr.shape)))
    return out


def write_layout(out: Path, model: str = "V4-Flash", n_shards: int = 46) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HERE / f"{model}.config.json", out / "config.json")
    tensors = source_tensors(ModelConfig.load(out / "config.json"))
    total = sum(m.nbytes for _, m in tensors)
    shards: list[list[tuple[str, TensorMeta]]] = [[] for _ in range(n_shards)]
    done = 0
    for name, meta in tensors:  # by size, a module's tensors together (scales follow weights)
        if not re.search(r"\.scale$", name):
            shard = min(n_shards - 1, done * n_shards // total)
        shards[shard].append((name, meta))
        done += meta.nbytes
    weight_map: dict[str, str] = {}
    for i, part in enumerate(shards):
        fname = SHARD_NAME.format(i + 1, n_shards)
        create_file(
            out / fname, build_header(part, {"format": "pt"}), sum(m.nbytes for _, m in part)
        )
        weight_map.update({k: fname for k, _ in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=("V4-Flash", "V4-Pro"), default="V4-Flash")
    ap.add_argument("--shards", type=int, default=46)
    args = ap.parse_args()
    write_layout(args.out, args.model, args.shards)


if __name__ == "__main__":
    main()
