"""Write a tiny random Kimi K2 checkpoint: Instruct (block FP8) or Thinking (INT4 experts).

The layout is Kimi K2's (``reference/model_families.md`` §1): ``config.json`` with every key of
the real one — ``model_type: kimi_k2`` with ``DeepseekV3ForCausalLM``, ``first_k_dense_replace``
1, ``n_group`` / ``topk_group`` 1 (flat top-k), ``routed_scaling_factor`` 2.827, no MTP layer,
``rope_theta`` 50000 and YaRN with ``beta_fast`` 1 — DeepSeek-V3's tensor names, K2's tokenizer
files (``tiktoken.model``, ``tokenization_kimi.py``, ``tokenizer_config.json``,
``chat_template.jinja``) and the remote-code names of its config. Dims are tiny and awkward on
purpose: 12 routed experts, 2 heads, ``kv_a_proj_with_mqa`` 144 rows and ``kv_b_proj`` 224 rows
(partial FP8 blocks), a vocabulary that is no power of two (its last 256 ids reserved specials,
as K2's 163,584 + 256).

- ``instruct``: every linear block FP8 (E4M3 + F32 ``weight_scale_inv`` per 128×128), BF16 norms,
  embeddings and router, F32 ``e_score_correction_bias`` — as DeepSeek-V3 ships.
- ``thinking``: the routed experts compressed-tensors ``pack-quantized`` INT4, group 32,
  symmetric, BF16 ``weight_scale``, I32 ``weight_shape`` (as vllm-ascend's w4a16 docstring lists
  Kimi-K2-Thinking's); everything else BF16; config.json's ``quantization_config`` is
  compressed-tensors' with K2.5's ``ignore`` list (``reference/awq_ct.md`` §2.7).

The tensors are the tiny DeepSeek-V3 generator's (``examples/tiny-tools/make_tiny.py``,
deterministic integer noise) for this config; the Thinking experts are those FP8 weights
dequantized and quantized round-to-nearest. ``tokenization_kimi.py`` and the chat template are
short stand-ins under Moonshot's file names, written for this test model (Moonshot's code is not
copied); ``tiktoken.model`` holds byte-level BPE ranks (``base64(token) rank`` per line, as
tiktoken reads) trained on a fixed text.

    python examples/kimi-k2/make_tiny.py OUT [--variant instruct|thinking]
"""

from __future__ import annotations

import argparse
import base64
import copy
import runpy
from collections import Counter
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import torch

from hetquant.formats import get_format

HERE = Path(__file__).resolve().parent
DS = SimpleNamespace(**runpy.run_path(str(HERE.parent / "tiny-tools" / "make_tiny.py")))
COMMON = DS.common
N_ORDINARY = 700  # ordinary BPE tokens (K2: 163,584)
N_RESERVED = 256  # special / reserved ids after them (K2: 256)
VOCAB = N_ORDINARY + N_RESERVED
BOS, EOS, IM_END = N_ORDINARY, N_ORDINARY + 1, N_ORDINARY + 2  # K2: 163584, 163585, 163586
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
            "<|im_middle|>", "[UNK]", "[PAD]"]  # fmt: skip
N_SHARDS = 4
CT_GROUP = 32
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]  # fmt: skip

# Kimi-K2-Instruct's config.json keys (DeepSeek-V3's plus model_type kimi_k2), K2's values where
# they differ from DeepSeek-V3's, tiny dims.
CONFIG = {
    **{k: v for k, v in COMMON.CONFIG.items()},
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "first_k_dense_replace": 1,
    "hidden_size": 512,
    "intermediate_size": 768,
    "kv_lora_rank": 128,
    "max_position_embeddings": 4096,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 256,
    "n_group": 1,
    "n_routed_experts": 12,
    "n_shared_experts": 1,
    "num_attention_heads": 2,
    "num_experts_per_tok": 3,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 256,
    "qk_nope_head_dim": 48,
    "qk_rope_head_dim": 16,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "v_head_dim": 64,
    "vocab_size": VOCAB,
}

CHAT_TEMPLATE = (  # K2's turn markers; a short stand-in for Moonshot's template
    "{%- for message in messages -%}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' }}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

TOKENIZATION_KIMI = '''"""Stand-in for Moonshot's ``tokenization_kimi.py`` in hetquant's tiny Kimi K2 test model:
same file and class name; ranks from ``tiktoken.model``, specials after them. A complete slow
tokenizer (vocabulary, token <-> id, text <-> tokens), so transformers' ``AutoTokenizer`` and
vLLM load it with ``trust_remote_code``; a token's string is its bytes, one character per byte
(latin-1)."""

from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(vocab_file)
        specials = {t: len(ranks) + i for i, t in enumerate(%r)}
        self.model = tiktoken.Encoding("kimi-tiny", pat_str=r"\\S+|\\s+", mergeable_ranks=ranks,
                                       special_tokens=specials)
        self.encoder = {b.decode("latin-1"): i for b, i in ranks.items()} | specials
        self.decoder = {i: t for t, i in self.encoder.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        ids = self.model.encode(text, allowed_special="all")
        return [self.decoder[i] for i in ids]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder["[UNK]"])

    def _convert_id_to_token(self, index):
        return self.decoder.get(index, "[UNK]")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).encode("latin-1").decode("utf-8", errors="replace")
'''


def bpe_ranks(text: bytes, n_tokens: int) -> list[bytes]:
    """Byte-level BPE tokens of ``text``, in rank order: the 256 bytes, then merges of the most
    frequent adjacent pair (ties: the smallest pair) until ``n_tokens`` (deterministic)."""
    tokens = [bytes([b]) for b in range(256)]
    words = [[bytes([b]) for b in w] for w in text.split()]
    while len(tokens) < n_tokens:
        pairs = Counter((a, b) for w in words for a, b in pairwise(w))
        if not pairs:
            raise RuntimeError("bpe_ranks: the text has too few pairs for the vocabulary")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        tokens.append(best[0] + best[1])
        words = [_merge(w, best) for w in words]
    return tokens


def _merge(word: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _corpus() -> bytes:
    """A fixed training text: this file's and the DeepSeek generator's docstrings, repeated words
    being frequent enough for the merges."""
    texts = [__doc__ or "", DS.__doc__ or "", COMMON.__doc__ or ""]
    return ("\n".join(texts) * 3).encode()


def tokenizer_files(out: Path, eos: int) -> None:
    """K2's tokenizer files and generation_config.json (its bos / eos) into ``out``."""
    ranks = bpe_ranks(_corpus(), N_ORDINARY)
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(ranks)]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    specials = SPECIALS + [f"<|reserved_token_{i}|>" for i in range(len(SPECIALS), N_RESERVED)]
    (out / "tokenization_kimi.py").write_text(TOKENIZATION_KIMI % (specials,))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    generation = {
        "bos_token_id": BOS,
        "eos_token_id": eos,
        "max_length": CONFIG["max_position_embeddings"],
    }
    COMMON.write_json(out / "generation_config.json", generation)
    added = {str(N_ORDINARY + i): {"content": t, "special": True} for i, t in enumerate(specials)}
    COMMON.write_json(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": added,
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "bos_token": "[BOS]",
            "eos_token": specials[eos - N_ORDINARY],
            "model_max_length": CONFIG["max_position_embeddings"],
            "pad_token": "[PAD]",
            "tokenizer_class": "TikTokenTokenizer",
            "unk_token": "[UNK]",
        },
    )


def thinking_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 weights dequantized to BF16; routed experts compressed-tensors INT4 g32 (I32 shape)."""
    fp8 = get_format("fp8_block")
    ct = get_format("ct_pack_quantized", group_size=CT_GROUP, shape_dtype="I32")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if f"{name}_scale_inv" in tensors:
            t = fp8.dequantize_bf16(t, tensors[f"{name}_scale_inv"])
        if ".mlp.experts." in name:
            prefix = name.removesuffix(".weight")
            out.update({f"{prefix}.{k}": v for k, v in ct.quantize(t.float()).items()})
        else:
            out[name] = t
    return out


def config_for(variant: str) -> dict:
    cfg = copy.deepcopy(CONFIG)
    if variant == "thinking":
        ct = get_format("ct_pack_quantized", group_size=CT_GROUP)
        cfg["quantization_config"] = ct.quantization_config(ignore=IGNORE)
        cfg["eos_token_id"] = IM_END
    return cfg


def _shard_of(name: str) -> int:
    """Globals in the first and last shard, layer L in shard L + 1 (one scale moved a shard on,
    as happens in the real checkpoint)."""
    if not name.startswith("model.layers."):
        return 1 if name.startswith("model.embed") else N_SHARDS
    layer = int(name.split(".")[2])
    moved = name.endswith("self_attn.o_proj.weight_scale_inv") and layer == 0
    return min(layer + 1 + int(moved), N_SHARDS)


def write_checkpoint(out: Path, variant: str = "instruct") -> dict[str, int]:
    """Every file of the tiny K2 ``variant`` into ``out``; {file: bytes}."""
    if variant not in ("instruct", "thinking"):
        raise ValueError(f"variant {variant!r}: instruct or thinking")
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_for(variant)
    tensors = DS.build_tensors(cfg)
    if variant == "thinking":
        tensors = thinking_tensors(tensors)
    (out / "tokenizer.json").write_text("{}")  # write_checkpoint_files lists it; K2 has none
    COMMON.write_checkpoint_files(out, tensors, _shard_of, N_SHARDS, cfg, {})
    (out / "tokenizer.json").unlink()
    tokenizer_files(out, cfg["eos_token_id"])  # K2's tokenizer_config.json, not DeepSeek's
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=("instruct", "thinking"), default="instruct")
    args = ap.parse_args()
    for name, size in write_checkpoint(args.out, args.variant).items():
        print(f"{size:>10,d}  {name}")


if __name__ == "__main__":
    main()
