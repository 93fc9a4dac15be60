"""Calibration and evaluation text → token blocks [N, L], with the checkpoint's own tokenizer.

The rule (deterministic, no seed, no shuffling):

1. Documents, in order: the files in the order given; a ``.jsonl`` file is one document per
   non-empty line (its ``"text"`` field — the format of AutoAWQ's default pile-val set), any
   other file is one document (its whole UTF-8 text).
2. Each document is encoded whole with ``tokenizer.json`` (``tokenizers``; in a child process,
   under a deadline: the file is untrusted, ``encoding.py``) with the tokenizer's own special
   tokens — for DeepSeek-V3/R1 that prepends BOS, as at the start of any prompt — and followed
   by EOS (``eos_token_id`` of config.json). Documents that encode to nothing but
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
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.families import load_json
from hetquant.formats.families.fields import ConfigFields

from .encoding import BoundedEncoder

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


def load_tokenizer(model_dir: str | Path) -> tuple[Any, int]:
    """``(tokenizers.Tokenizer, eos_id)`` from ``model_dir``'s tokenizer.json and config.json.

    Both are untrusted: a file the tokenizers library cannot read, or an ``eos_token_id`` that is
    not a token id of that tokenizer, is a HetquantError naming the file. Encoding with it is
    bounded separately (``encoding.py``)."""
    from tokenizers import Tokenizer

    root = Path(model_dir)
    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        raise HetquantError(f"{root}: no tokenizer.json; calibration needs the model's tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the library raises Exception, or panics
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise HetquantError(
            f"{tok_path}: not a tokenizer the tokenizers library reads ({first}); "
            "use the tokenizer.json published with the checkpoint"
        ) from None
    return tokenizer, _eos_id(
        root / "config.json", tokenizer.get_vocab_size(with_added_tokens=True)
    )


def _eos_id(cfg: Path, vocab: int) -> int:
    """config.json's ``eos_token_id`` (the first of a list; a VLM's in ``text_config``): a token
    id below ``vocab``."""
    raw = load_json(cfg) if cfg.is_file() else {}
    if not isinstance(raw, dict):
        raise HetquantError(f"{cfg}: expected a JSON object")
    eos = raw.get("eos_token_id")
    text = raw.get("text_config")
    if eos is None and isinstance(text, dict):  # a vision-language model's: its text decoder's
        eos = text.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise HetquantError(f"{cfg}: no eos_token_id; cannot separate calibration documents")
    f = ConfigFields({"eos_token_id": eos}, str(cfg))
    return f.integer("eos_token_id", lo=0, hi=max(vocab - 1, 0))


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
            try:
                doc["text"].encode("utf-8")
            except UnicodeEncodeError as e:  # a JSON escape of a lone surrogate
                raise HetquantError(f"{path}:{i}: text is not valid Unicode ({e})") from None
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
    with BoundedEncoder(tokenizer) as encode:
        for text in documents(files):
            ids = encode(text)
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
