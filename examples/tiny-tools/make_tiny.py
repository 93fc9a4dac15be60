"""Build the tiny DeepSeek-V3-architecture FP8 checkpoint that lives beside this script.

The checkpoint is laid out exactly as DeepSeek ships V3 / R1 (``reference/ascend_formats.md`` §1):
the HF ``config.json`` with every key of the real one, the real tensor names, dtypes and shape
rules (block-FP8 linears with an F32 ``weight_scale_inv`` of shape [ceil(out/128), ceil(in/128)],
BF16 norms / embeddings / router, F32 ``e_score_correction_bias``), the MTP layer at index
``num_hidden_layers`` with its extra tensors in the last shard, shards named
``model-%05d-of-%06d.safetensors`` (DeepSeek writes the total with six digits) and a
``model.safetensors.index.json`` that maps every tensor, scales included. Two weight / scale pairs
are split across shards on purpose, one each way, as happens in the real checkpoint.

Everything is deterministic. Each tensor is drawn from its own ``torch.Generator`` seeded from
``SEED`` and the tensor's name, using integer draws only (a sum of four uniform integers, scaled:
an Irwin-Hall approximation of a normal), so the float values do not depend on the CPU's vector
unit or on libm. The tokenizer (byte-level BPE trained on CPython's ``pydoc_data.topics``) is
reused from this folder unless ``--retrain-tokenizer`` is given, because that training text
changes between Python versions; the training itself is byte-deterministic.

Usage::

    python examples/tiny-tools/make_tiny.py                  # rewrite the files here
    python examples/tiny-tools/make_tiny.py --out /tmp/tiny   # same bytes, elsewhere
    python examples/tiny-tools/make_tiny.py --retrain-tokenizer
"""

from __future__ import annotations

import argparse
import math
import re
import runpy
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from hetquant.formats.fp8_block import Fp8Block

HERE = Path(__file__).resolve().parent
CHECKPOINT = HERE.parent / "tiny-deepseek-v3"  # what this script writes by default
common = SimpleNamespace(**runpy.run_path(str(HERE / "common.py")))  # shared with train.py
SEED = 20241226  # DeepSeek-V3's release date
FP8 = Fp8Block()
CONFIG = common.CONFIG  # every key of DeepSeek-V3's config.json, tiny dims
VOCAB_SIZE = CONFIG["vocab_size"]


# ----------------------------------------------------------------------------------------------
# tensors


def _noise(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return common.noise(SEED, name, shape)


def _bf16(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    return (_noise(name, shape) * std + mean).to(torch.bfloat16)


def _norm(name: str, size: int) -> dict[str, torch.Tensor]:
    return {name: _bf16(name, (size,), std=0.05, mean=1.0)}


def _linear_fp8(prefix: str, out: int, inp: int) -> dict[str, torch.Tensor]:
    """A block-FP8 linear [out, in]: ``weight`` (E4M3) and ``weight_scale_inv`` (F32)."""
    name = f"{prefix}.weight"
    w = (_noise(name, (out, inp)) / math.sqrt(inp)).to(torch.float32)
    q = FP8.quantize(w)
    return {name: q["weight"], f"{name}_scale_inv": q["weight_scale_inv"]}


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return {
        **_linear_fp8(f"{prefix}.gate_proj", inter, hidden),
        **_linear_fp8(f"{prefix}.up_proj", inter, hidden),
        **_linear_fp8(f"{prefix}.down_proj", hidden, inter),
    }


def _attention(prefix: str, c: dict) -> dict[str, torch.Tensor]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
    return {
        **_linear_fp8(f"{prefix}.q_a_proj", q_rank, h),
        **_norm(f"{prefix}.q_a_layernorm.weight", q_rank),
        **_linear_fp8(f"{prefix}.q_b_proj", heads * (nope + rope), q_rank),
        **_linear_fp8(f"{prefix}.kv_a_proj_with_mqa", kv_rank + rope, h),
        **_norm(f"{prefix}.kv_a_layernorm.weight", kv_rank),
        **_linear_fp8(f"{prefix}.kv_b_proj", heads * (nope + v), kv_rank),
        **_linear_fp8(f"{prefix}.o_proj", h, heads * v),
    }


def _moe(prefix: str, c: dict) -> dict[str, torch.Tensor]:
    h, n_exp, inter = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    bias = f"{prefix}.gate.e_score_correction_bias"
    tensors = {
        f"{prefix}.gate.weight": _bf16(f"{prefix}.gate.weight", (n_exp, h), 1 / math.sqrt(h)),
        bias: (_noise(bias, (n_exp,)) * 0.01).to(torch.float32),
    }
    for e in range(n_exp):
        tensors.update(_mlp(f"{prefix}.experts.{e}", h, inter))
    tensors.update(_mlp(f"{prefix}.shared_experts", h, inter * c["n_shared_experts"]))
    return tensors


def _decoder_layer(layer: int, c: dict) -> dict[str, torch.Tensor]:
    p, h = f"model.layers.{layer}", c["hidden_size"]
    dense = layer < c["first_k_dense_replace"]
    return {
        **_norm(f"{p}.input_layernorm.weight", h),
        **_attention(f"{p}.self_attn", c),
        **_norm(f"{p}.post_attention_layernorm.weight", h),
        **(_mlp(f"{p}.mlp", h, c["intermediate_size"]) if dense else _moe(f"{p}.mlp", c)),
    }


def build_tensors(c: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, main model then MTP layer(s), by name."""
    h, vocab = c["hidden_size"], c["vocab_size"]
    embed = _bf16("model.embed_tokens.weight", (vocab, h), std=1.0)
    head = _bf16("lm_head.weight", (vocab, h), std=1 / math.sqrt(h))
    tensors = {"model.embed_tokens.weight": embed}
    for layer in range(c["num_hidden_layers"]):
        tensors.update(_decoder_layer(layer, c))
    tensors.update(_norm("model.norm.weight", h))
    tensors["lm_head.weight"] = head
    for k in range(c["num_nextn_predict_layers"]):
        layer = c["num_hidden_layers"] + k
        p = f"model.layers.{layer}"
        tensors.update(_decoder_layer(layer, c))
        tensors.update(_norm(f"{p}.enorm.weight", h))
        tensors.update(_norm(f"{p}.hnorm.weight", h))
        tensors[f"{p}.eh_proj.weight"] = _bf16(
            f"{p}.eh_proj.weight", (h, 2 * h), 1 / math.sqrt(2 * h)
        )
        # DeepSeek stores the MTP layer's embedding and head as copies of the main model's.
        tensors[f"{p}.embed_tokens.weight"] = embed.clone()
        tensors.update(_norm(f"{p}.shared_head.norm.weight", h))
        tensors[f"{p}.shared_head.head.weight"] = head.clone()
    return tensors


# ----------------------------------------------------------------------------------------------
# shards


def shard_of(name: str, c: dict) -> int:
    """1-based shard of tensor ``name``: roughly one decoder layer per shard, in order.

    1: embed + dense layer 0, except layer 0's ``kv_a_proj_with_mqa.weight_scale_inv`` -> 2
       (a scale in a LATER shard than its weight);
    2: layer 1;  3: layer 2, except its last expert's ``down_proj.weight`` -> 4
       (a weight in a later shard than its scale);
    4: the MTP layer's decoder part, model.norm, lm_head;  5: the MTP extras (as DeepSeek's last).
    """
    if name == "model.embed_tokens.weight":
        return 1
    if name in ("model.norm.weight", "lm_head.weight"):
        return 4
    layer = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
    sub = name.split(".", 3)[3]
    if layer == 0:
        return 2 if sub == "self_attn.kv_a_proj_with_mqa.weight_scale_inv" else 1
    if layer == 1:
        return 2
    if layer == 2:
        return 4 if sub == f"mlp.experts.{c['n_routed_experts'] - 1}.down_proj.weight" else 3
    return 5 if sub.split(".")[0] in common.MTP_EXTRAS else 4


N_SHARDS = 5


# ----------------------------------------------------------------------------------------------
# tokenizer


def _corpus() -> Iterator[str]:
    from pydoc_data.topics import topics  # English prose that ships with CPython

    for key in sorted(topics):
        yield topics[key]


def train_tokenizer(vocab_size: int) -> str:
    """The tokenizer trained on ``pydoc_data.topics``, one document per topic (JSON text)."""
    return common.train_tokenizer(_corpus(), vocab_size)


# ----------------------------------------------------------------------------------------------
# writing


def write_checkpoint(
    out: Path, retrain_tokenizer: bool = False, overrides: dict | None = None
) -> dict[str, int]:
    """Write every checkpoint file into ``out``; return {file name: size in bytes}.
    ``overrides``: config keys to change (e.g. ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64,
    the MLA latent of the real model, 576, which vLLM's CPU MLA kernel requires)."""
    out.mkdir(parents=True, exist_ok=True)
    committed = CHECKPOINT / "tokenizer.json"
    if retrain_tokenizer or not committed.exists():
        (out / "tokenizer.json").write_text(train_tokenizer(VOCAB_SIZE), encoding="utf-8")
    elif out.resolve() != CHECKPOINT.resolve():
        shutil.copyfile(committed, out / "tokenizer.json")

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = {**CONFIG, **(overrides or {}), "vocab_size": vocab}  # = the tokenizer's size
    tensors = build_tensors(config)
    return common.write_checkpoint_files(
        out, tensors, lambda name: shard_of(name, config), N_SHARDS, config,
        common.TOKENIZER_CONFIG,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=CHECKPOINT, help=f"output folder (default: {CHECKPOINT})"
    )
    parser.add_argument(
        "--retrain-tokenizer",
        action="store_true",
        help="train tokenizer.json again instead of reusing the committed one",
    )
    args = parser.parse_args()
    sizes = write_checkpoint(args.out, args.retrain_tokenizer)
    for name, size in sizes.items():
        print(f"{size:>10,d}  {name}")
    print(f"{sum(sizes.values()):>10,d}  total in {args.out}")


if __name__ == "__main__":
    main()
