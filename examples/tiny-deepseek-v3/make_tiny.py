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

    python examples/tiny-deepseek-v3/make_tiny.py                  # rewrite the files here
    python examples/tiny-deepseek-v3/make_tiny.py --out /tmp/tiny   # same bytes, elsewhere
    python examples/tiny-deepseek-v3/make_tiny.py --retrain-tokenizer
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from hetquant.formats.fp8_block import Fp8Block

HERE = Path(__file__).resolve().parent
SEED = 20241226  # DeepSeek-V3's release date
FP8 = Fp8Block()

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
CHAT_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]  # added, not special
VOCAB_SIZE = 640  # 5 x 128; keeps the four [V, H] BF16 matrices (embed, head, MTP copies) ~1.3 MB

# The real DeepSeek-V3 HF config.json, every key, in its (alphabetical) order, with tiny dims.
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 128,
    "max_position_embeddings": 4096,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 256,
    "moe_layer_freq": 1,
    "n_group": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": VOCAB_SIZE,
}

GENERATION_CONFIG = {  # DeepSeek-R1's sampling defaults
    "_from_model_config": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "transformers_version": "4.46.3",
}

# A shortened R1-style template: system prompt after BOS, <｜User｜>/<｜Assistant｜> turns, and
# the generation prompt opening a <think> block (no tool-call handling).
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)


def _added_token(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


TOKENIZER_CONFIG = {  # DeepSeek-R1's keys and order
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": _added_token(BOS),
    "clean_up_tokenization_spaces": False,
    "eos_token": _added_token(EOS),
    "legacy": True,
    "model_max_length": CONFIG["max_position_embeddings"],
    "pad_token": _added_token(EOS),
    "sp_model_kwargs": {},
    "unk_token": None,
    "tokenizer_class": "LlamaTokenizerFast",
    "chat_template": CHAT_TEMPLATE,
}


# ----------------------------------------------------------------------------------------------
# tensors


def _noise(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Zero-mean, unit-variance float64 noise for tensor ``name``, identical on every platform.

    Sum of four uniform integers in [0, 2**24) (Irwin-Hall, range ±2·sqrt(3)); only integer draws
    and correctly rounded float64 arithmetic, so no vectorized transcendental can change a bit.
    """
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    draws = torch.randint(0, 1 << 24, (4, *shape), generator=gen, dtype=torch.int64)
    return (draws.sum(0).to(torch.float64) / (1 << 24) - 2.0) * math.sqrt(3.0)


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

MTP_EXTRAS = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")


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
    return 5 if sub.split(".")[0] in MTP_EXTRAS else 4


N_SHARDS = 5


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:06d}.safetensors"  # DeepSeek's six-digit total


# ----------------------------------------------------------------------------------------------
# tokenizer


def _corpus() -> Iterator[str]:
    from pydoc_data.topics import topics  # English prose that ships with CPython

    for key in sorted(topics):
        yield topics[key]


def train_tokenizer(vocab_size: int) -> str:
    """Byte-level BPE (DeepSeek-style pieces) trained on ``pydoc_data.topics``; JSON text."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS),
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2 as in DeepSeek's vocabulary
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TOKENS])
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 0)]
            ),
        ]
    )
    if tok.token_to_id(BOS) != 0 or tok.token_to_id(EOS) != 1:
        raise RuntimeError("tokenizer: BOS/EOS did not get ids 0/1")
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer: vocab {tok.get_vocab_size()} != {vocab_size}")
    return tok.to_str(pretty=True) + "\n"


# ----------------------------------------------------------------------------------------------
# writing


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_checkpoint(out: Path, retrain_tokenizer: bool = False) -> dict[str, int]:
    """Write every checkpoint file into ``out``; return {file name: size in bytes}."""
    out.mkdir(parents=True, exist_ok=True)
    committed = HERE / "tokenizer.json"
    if retrain_tokenizer or not committed.exists():
        (out / "tokenizer.json").write_text(train_tokenizer(VOCAB_SIZE), encoding="utf-8")
    elif out.resolve() != HERE:
        shutil.copyfile(committed, out / "tokenizer.json")

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = {**CONFIG, "vocab_size": vocab}  # = the tokenizer's size
    tensors = build_tensors(config)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(N_SHARDS)]
    for name, t in tensors.items():
        shards[shard_of(name, config) - 1][name] = t
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = shard_name(i, N_SHARDS)
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    _write_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)
    files = [shard_name(i, N_SHARDS) for i in range(1, N_SHARDS + 1)]
    files += ["model.safetensors.index.json", "config.json", "generation_config.json"]
    files += ["tokenizer.json", "tokenizer_config.json"]
    return {f: (out / f).stat().st_size for f in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: here)")
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
