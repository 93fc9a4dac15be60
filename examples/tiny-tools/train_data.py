"""``train.py``'s data: text → token stream → shuffled windows ``[BOS] + seq_len`` tokens.

Text is cut into paragraphs (after each blank line) for the tokenizer, both to train it and to
encode; samples are non-overlapping windows of the stream at a random offset per epoch,
shuffled, deterministic in the seed.
"""

from __future__ import annotations

import torch

__all__ = ["Batches", "encode", "paragraphs", "windows"]


def paragraphs(text: str) -> list[str]:
    """``text`` cut after each blank line (pieces rejoin to ``text``): the encoding unit."""
    parts = text.split("\n\n")
    return [p + "\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def encode(tokenizer_json: str, text: str) -> torch.Tensor:
    """The token stream of ``text`` (no special tokens), int64 [n]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    ids: list[int] = []
    for enc in tok.encode_batch(paragraphs(text), add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, seq_len: int, offset: int = 0) -> torch.Tensor:
    """Non-overlapping samples ``[BOS] + stream[o : o + seq_len]``, int64 [n, seq_len + 1]."""
    n = (stream.numel() - offset) // seq_len
    body = stream[offset : offset + n * seq_len].view(n, seq_len)
    return torch.cat([torch.zeros(n, 1, dtype=torch.int64), body], dim=1)  # BOS = 0


class Batches:
    """Epochs of shuffled windows (a fresh random offset per epoch), deterministic in ``seed``."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> None:
        self.stream, self.seq_len, self.batch, self.seed = stream, seq_len, batch, seed
        self.epoch, self.queue = -1, torch.empty(0, seq_len + 1, dtype=torch.int64)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, (self.stream.numel() - self.seq_len) // self.seq_len // self.batch)

    def next(self) -> torch.Tensor:
        if self.queue.shape[0] < self.batch:
            self.epoch += 1
            gen = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
            offset = int(torch.randint(0, self.seq_len, (1,), generator=gen))
            w = windows(self.stream, self.seq_len, offset)
            self.queue = w[torch.randperm(w.shape[0], generator=gen)]
        out, self.queue = self.queue[: self.batch], self.queue[self.batch :]
        return out
