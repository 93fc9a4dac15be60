"""What ``make_tiny.py`` and ``train.py`` both write: DeepSeek-V3's checkpoint conventions.

- ``CONFIG``, ``GENERATION_CONFIG``, ``TOKENIZER_CONFIG``: the real HF files' keys (R1's values,
  tiny dims);
- ``train_tokenizer``: the one byte-level BPE trainer (DeepSeek's special tokens at 0, 1, 2);
- ``noise``: platform-independent initial values (``draw.py``: integer draws only);
- ``shard_name`` / ``write_checkpoint_files``: shards, index and JSON files as DeepSeek names them.

The scripts load their siblings with ``sibling(name)`` (``runpy``: no ``__pycache__`` is
written into this folder, which the tests read file by file).
"""

from __future__ import annotations

import json
import runpy
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

__all__ = [
    "BOS",
    "CHAT_TOKENS",
    "CONFIG",
    "EOS",
    "GENERATION_CONFIG",
    "MTP_EXTRAS",
    "PAD",
    "TOKENIZER_CONFIG",
    "noise",
    "shard_name",
    "sibling",
    "train_tokenizer",
    "write_checkpoint_files",
    "write_json",
]

HERE = Path(__file__).resolve().parent

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
CHAT_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]  # added, not special
MTP_EXTRAS = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")  # the MTP layer's own

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
    "vocab_size": 640,  # 5 x 128; keeps make_tiny's four [V, H] BF16 matrices ~1.3 MB
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


def sibling(name: str) -> SimpleNamespace:
    """The module ``name``.py of this folder, run without writing bytecode beside it."""
    return SimpleNamespace(**runpy.run_path(str(HERE / f"{name}.py")))


def noise(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Zero-mean, unit-variance float64 noise for tensor ``name``, identical on every platform
    (``draw.seeded``: integer draws and correctly rounded float64 arithmetic only)."""
    return sibling("draw").seeded(seed, name, shape)


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> str:
    """Byte-level BPE (DeepSeek-style pieces: digits in runs of up to 3) trained on
    ``documents``; ids 0, 1, 2 = BOS, EOS, PAD, the chat tokens added last; JSON text.
    Byte-deterministic for the same documents."""
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
    tok.train_from_iterator(documents, trainer=trainer)
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


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:06d}.safetensors"  # DeepSeek's six-digit total


def write_checkpoint_files(
    out: Path,
    tensors: dict[str, torch.Tensor],
    shard_of: Callable[[str], int],
    n_shards: int,
    config: dict,
    tokenizer_config: dict,
) -> dict[str, int]:
    """``tensors`` into ``n_shards`` shards (tensor → 1-based ``shard_of``), the index, config,
    generation and tokenizer configs; ``out/tokenizer.json`` must be there. {file: bytes}."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    for name, t in tensors.items():
        shards[shard_of(name) - 1][name] = t
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = shard_name(i, n_shards)
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", GENERATION_CONFIG)
    write_json(out / "tokenizer_config.json", tokenizer_config)
    files = [shard_name(i, n_shards) for i in range(1, n_shards + 1)]
    files += ["model.safetensors.index.json", "config.json", "generation_config.json"]
    files += ["tokenizer.json", "tokenizer_config.json"]
    return {f: (out / f).stat().st_size for f in files}
