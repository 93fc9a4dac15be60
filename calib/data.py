"""Calibration and evaluation text → token blocks [N, L], with the checkpoint's own tokenizer.

The rule (deterministic, no seed, no shuffling):

1. Documents, in order: the files in the order given; a ``.jsonl`` file is one document per
   non-empty line (its ``"text"`` field — the format of AutoAWQ's default pile-val set), any
   other file is one document (its whole UTF-8 text).
2. Each document is encoded with ``tokenizer.json`` (``tokenizers``) with the tokenizer's own
   special tokens — for DeepSeek-V3/R1 that prepends BOS, as at the start of any prompt — and
   followed by EOS (``eos_token_id`` of config.json). Documents that encode to nothing but
   special tokens are skipped.
3. The documents' tokens are concatenated into one stream and cut into consecutive
   non-overlapping blocks of ``seq_len`` tokens; the first ``n_samples`` blocks are the
   samples and the incomplete tail is dropped. Fewer complete blocks than asked is an error
   naming how many tokens there are and how many are needed.

This is AutoAWQ's rule (concatenate, split into blocks; ``awq/utils/calib_data.py``) without its
shuffle: the order of the files is the order of the samples. Encoding stops once enough tokens
are collected, so a large corpus costs only what is used.

Defaults: ``CALIB_SAMPLES = 128`` × ``CALIB_SEQ_LEN = 512`` = 65,536 tokens, AutoAWQ's
``max_calib_samples`` and ``max_calib_seq_len`` (for a 671B run: about 524k token-expert pairs,
≈ 2,000 tokens per routed expert). Evaluation: ``EVAL_SAMPLES = 8`` × ``EVAL_SEQ_LEN = 2048``
(16,376 scored positions; each forward's float32 logits are then 8.5 GB for DeepSeek-V3's
129,280-token vocabulary). Tests pass small sizes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from hetquant.formats import HetquantError
from hetquant.formats.json_io import load_json

__all__ = [
    "CALIB_SAMPLES",
    "CALIB_SEQ_LEN",
    "EVAL_SAMPLES",
    "EVAL_SEQ_LEN",
    "documents",
    "load_tokenizer",
    "token_blocks",
    "tokens_digest",
]

CALIB_SAMPLES = 128
CALIB_SEQ_LEN = 512
EVAL_SAMPLES = 8
EVAL_SEQ_LEN = 2048


def load_tokenizer(model_dir: str | Path):
    """``(tokenizers.Tokenizer, eos_id)`` from ``model_dir``'s tokenizer.json and config.json."""
    from tokenizers import Tokenizer

    root = Path(model_dir)
    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        raise HetquantError(f"{root}: no tokenizer.json; calibration needs the model's tokenizer")
    tokenizer = Tokenizer.from_file(str(tok_path))
    eos = None
    cfg = root / "config.json"
    if cfg.is_file():
        doc = load_json(cfg)
        eos = doc.get("eos_token_id") if isinstance(doc, dict) else None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise HetquantError(f"{cfg}: no eos_token_id; cannot separate calibration documents")
    return tokenizer, int(eos)


def documents(files: Sequence[str | Path]) -> Iterator[str]:
    """The documents of ``files`` in order (rule 1 of the module docstring)."""
    for f in files:
        path = Path(f)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise HetquantError(f"{path}: calibration text not found") from None
        except UnicodeDecodeError as e:
            raise HetquantError(f"{path}: not UTF-8 text ({e})") from None
        if path.suffix != ".jsonl":
            yield text
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise HetquantError(f"{path}:{i}: not a JSON line ({e})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise HetquantError(f'{path}:{i}: expected an object with a "text" string')
            yield doc["text"]


def token_blocks(
    files: Sequence[str | Path],
    tokenizer,
    eos_id: int,
    n_samples: int = CALIB_SAMPLES,
    seq_len: int = CALIB_SEQ_LEN,
) -> torch.Tensor:
    """Token ids int64 [n_samples, seq_len] from ``files`` (rules 1-3 of the module docstring)."""
    if n_samples < 1 or seq_len < 2:
        raise HetquantError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples}, {seq_len}")
    want = n_samples * seq_len
    special = set(tokenizer.get_added_tokens_decoder()) | {eos_id}
    stream: list[int] = []
    for text in documents(files):
        ids = tokenizer.encode(text).ids
        if all(i in special for i in ids):
            continue
        stream.extend(ids)
        stream.append(eos_id)
        if len(stream) >= want:
            break
    if len(stream) < want:
        raise HetquantError(
            f"calibration text has {len(stream)} tokens; {n_samples} samples × {seq_len} tokens "
            f"need {want} — give more text or fewer / shorter samples"
        )
    return torch.tensor(stream[:want], dtype=torch.long).reshape(n_samples, seq_len)


def tokens_digest(tokens: torch.Tensor) -> str:
    """sha256 of the token ids (int64 little-endian, row-major): records what was calibrated on."""
    return hashlib.sha256(tokens.to(torch.long).contiguous().numpy().tobytes()).hexdigest()
