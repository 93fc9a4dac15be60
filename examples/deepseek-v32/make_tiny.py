"""Write a tiny random DeepSeek-V3.2 checkpoint: the tiny DeepSeek-V3 plus the lightning indexer.

``config.json`` is the tiny DeepSeek-V3's (``examples/tiny-deepseek-v3``) with V3.2's identity
(``model_type: deepseek_v32``, ``DeepseekV32ForCausalLM``), its indexer keys (``index_n_heads``,
``index_head_dim``, ``index_topk``) and ``quantization_config.scale_fmt: ue8m0`` (every block scale
a power of two, as V3.1 / V3.2 ship: ``reference/model_families.md`` §3-4). Every decoder layer, the
MTP layer included, holds ``self_attn.indexer.{wq_b, wk}`` (block FP8 + F32 ``weight_scale_inv``),
``k_norm.{weight, bias}`` (BF16 LayerNorm) and ``weights_proj`` (BF16). Awkward on purpose: 3
indexer heads of 64, so ``wq_b`` has 192 rows (a partial FP8 block row). The tokenizer is the tiny
DeepSeek-V3's ``tokenizer.json``.

    python examples/deepseek-v32/make_tiny.py OUT
"""

from __future__ import annotations

import argparse
import copy
import math
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
TINY = HERE.parent / "tiny-deepseek-v3"
DS = SimpleNamespace(**runpy.run_path(str(HERE.parent / "tiny-tools" / "make_tiny.py")))
COMMON = DS.common
N_SHARDS = 5

CONFIG = copy.deepcopy(COMMON.CONFIG)
CONFIG.update(
    architectures=["DeepseekV32ForCausalLM"],
    model_type="deepseek_v32",
    index_n_heads=3,
    index_head_dim=64,
    index_topk=8,
)
CONFIG["quantization_config"]["scale_fmt"] = "ue8m0"
CONFIG = dict(sorted(CONFIG.items()))  # DeepSeek's config.json is alphabetical


def indexer_tensors(layer: int, c: dict) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}.self_attn.indexer"
    heads, dim, h = c["index_n_heads"], c["index_head_dim"], c["hidden_size"]
    return {
        **DS._linear_fp8(f"{p}.wq_b", heads * dim, c["q_lora_rank"]),
        **DS._linear_fp8(f"{p}.wk", dim, h),
        **DS._norm(f"{p}.k_norm.weight", dim),
        f"{p}.k_norm.bias": DS._bf16(f"{p}.k_norm.bias", (dim,), std=0.02),
        f"{p}.weights_proj.weight": DS._bf16(f"{p}.weights_proj.weight", (heads, h),
                                              1 / math.sqrt(h)),
    }  # fmt: skip


def build_tensors(c: dict) -> dict[str, torch.Tensor]:
    """The tiny V3 tensors plus every layer's indexer, block scales rounded up to powers of two
    (ue8m0; the FP8 codes are kept)."""
    tensors = DS.build_tensors(c)
    for layer in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        tensors.update(indexer_tensors(layer, c))
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        tensors[name] = torch.exp2(torch.ceil(torch.log2(tensors[name])))
    return tensors


def write_checkpoint(out: Path) -> dict[str, int]:
    """Every file of the tiny V3.2 checkpoint into ``out``; {file: bytes}."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TINY / "tokenizer.json", out / "tokenizer.json")
    return COMMON.write_checkpoint_files(
        out, build_tensors(CONFIG), lambda n: DS.shard_of(n, CONFIG), N_SHARDS, CONFIG,
        COMMON.TOKENIZER_CONFIG,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    for name, size in write_checkpoint(ap.parse_args().out).items():
        print(f"{size:>10,d}  {name}")


if __name__ == "__main__":
    main()
