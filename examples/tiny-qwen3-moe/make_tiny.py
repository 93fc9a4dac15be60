"""Write a tiny random Qwen3-MoE checkpoint, laid out as the Qwen3-*-FP8 (or BF16) repos are.

Names, dtypes and config keys are Qwen3-MoE's (reference/model_families.md §2; transformers'
``Qwen3MoeConfig``): GQA attention ``self_attn.{q,k,v,o}_proj`` plus per-head ``q_norm`` /
``k_norm``, router ``mlp.gate``, per-expert ``mlp.experts.E.{gate,up,down}_proj``, a dense
``mlp.{gate,up,down}_proj`` in the ``mlp_only_layers`` layer, no shared expert, no MTP, untied
``lm_head``. ``--dtype fp8`` (default) stores every linear but the router as 128×128 block FP8
(E4M3 ``weight`` + F32 ``weight_scale_inv``, as DeepSeek; the real Qwen3-FP8 scale dtype is not
verified, see model_families.md §8) and the rest BF16; ``--dtype bf16`` stores everything BF16.

What makes it a test of the general case: ``k_proj`` / ``v_proj`` have 64 output rows (a partial
FP8 block: not a multiple of 128); one layer is dense (``mlp_only_layers``); three shards with one
scale in a later shard than its weight and one weight in a later shard than its scale. The
tokenizer files are the tiny DeepSeek-V3 example's (a 640-token byte-level BPE: Qwen's own has
151,936 tokens and would dwarf the model); the vocabulary size is the tokenizer's.

Everything is drawn from one seeded generator per tensor (seeded by SEED and the tensor's position;
``tiny-tools/draw.py``), so a run writes the same bytes on every CPU. About 4.5 MB (FP8), 8.5 MB
(BF16); every dim the Ascend FP4 tiling needs (N % 256, K % 64) holds, as it does for the real
models.

Usage::

    python examples/tiny-qwen3-moe/make_tiny.py OUT [--dtype fp8|bf16]
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from hetquant.formats.fp8_block import Fp8Block

HERE = Path(__file__).resolve().parent
DRAW = SimpleNamespace(**runpy.run_path(str(HERE.parent / "tiny-tools" / "draw.py")))
TOKENIZER_DIR = HERE.parent / "tiny-deepseek-v3"
SEED = 20250429  # Qwen3's release date

CONFIG = {  # Qwen3-30B-A3B's config.json keys, tiny dims
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "decoder_sparse_step": 1,
    "eos_token_id": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "max_window_layers": 3,
    "mlp_only_layers": [1],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "num_attention_heads": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 640,
}
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}  # fmt: skip
N_SHARDS = 3


def _is_moe(layer: int, c: dict) -> bool:
    return layer not in c["mlp_only_layers"] and (layer + 1) % c["decoder_sparse_step"] == 0


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name → shape (scales excluded), in model order, spelled out by hand."""
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
        }
        if not _is_moe(layer, c):
            i = c["intermediate_size"]
            out |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)}  # fmt: skip
            continue
        out[p + "mlp.gate.weight"] = (c["num_experts"], h)
        i = c["moe_intermediate_size"]
        for e in range(c["num_experts"]):
            out |= {
                f"{p}mlp.experts.{e}.gate_proj.weight": (i, h),
                f"{p}mlp.experts.{e}.up_proj.weight": (i, h),
                f"{p}mlp.experts.{e}.down_proj.weight": (h, i),
            }
    out |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    return out


def build_tensors(c: dict, dtype: str) -> dict[str, torch.Tensor]:
    """Random weights: norms ≈ 1, linears ~ N(0, 1/in); FP8 linears block-quantized."""
    fp8 = Fp8Block()
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(shapes(c).items()):
        x = DRAW.normal(SEED + i, shape)
        if len(shape) == 1:
            tensors[name] = (1 + 0.1 * x).to(torch.bfloat16)
            continue
        x = x / math.sqrt(shape[1])
        quantized = dtype == "fp8" and name.endswith("_proj.weight")  # router, embed, head: BF16
        if quantized:
            q = fp8.quantize(x)
            tensors |= {name: q["weight"], f"{name}_scale_inv": q["weight_scale_inv"]}
        else:
            tensors[name] = x.to(torch.bfloat16)
    return tensors


def shard_of(name: str, c: dict) -> int:
    """1: embedding + layer 0, except layer 0's q_proj scale → 2 (a scale after its weight);
    2: layer 1, plus that scale; 3: the last layers, norm, lm_head — the last layer's expert 0
    down_proj weight too, while its scale stays in shard 2 (a weight after its scale)."""
    if name.startswith("model.embed_tokens") or name.startswith("model.layers.0."):
        return 2 if name == "model.layers.0.self_attn.q_proj.weight_scale_inv" else 1
    last = c["num_hidden_layers"] - 1
    if name == f"model.layers.{last}.mlp.experts.0.down_proj.weight_scale_inv":
        return 2
    return 2 if name.startswith("model.layers.1.") else 3


def write_checkpoint(out: Path, dtype: str = "fp8", config: dict | None = None) -> Path:
    """Write the checkpoint into ``out`` (created); ``config`` overrides CONFIG's keys."""
    c = {**CONFIG, **(config or {})}
    if dtype == "fp8":
        c["quantization_config"] = FP8_CONFIG
    out.mkdir(parents=True, exist_ok=True)
    tensors = build_tensors(c, dtype)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(N_SHARDS)]
    for name, t in tensors.items():
        shards[shard_of(name, c) - 1][name] = t
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{N_SHARDS:05d}.safetensors"  # Qwen's five-digit total
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _json(out / "model.safetensors.index.json",
          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})  # fmt: skip
    _json(out / "config.json", c)
    _json(out / "generation_config.json", {"bos_token_id": c["bos_token_id"],
          "eos_token_id": c["eos_token_id"], "do_sample": False})  # fmt: skip
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / f, out / f)
    return out


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    args = ap.parse_args()
    write_checkpoint(args.out, args.dtype)


if __name__ == "__main__":
    main()
