"""Encoding text with an untrusted tokenizer, bounded: in a child process, under a deadline.

tokenizer.json comes from anyone (issue #25 §3). Its pre-tokenizer regexes run on onig, a
backtracking engine: a pattern such as ``(a+)+$`` takes time exponential in a run of matching
characters. onig gives up one match after 10⁷ retries, and the tokenizers library then *panics*
— a Rust panic that prints its message (and a backtrace under RUST_BACKTRACE) to stderr and
reaches Python as ``pyo3_runtime.PanicException``, a ``BaseException``. A pattern that stays under
the limit at each position can still take hours over one document, and encoding holds the GIL:
no thread of this process can interrupt it.

So encoding runs in a child (``_encode_worker.py``, stderr discarded) that can be killed. Each
document goes to it whole and its ids must come back within ``BASE_S + bytes / MIN_BYTES_PER_S``
seconds (30 s, plus 10 s per MB: a real tokenizer encodes several MB per second on one core, so
only a pathological one gets near). Past that the child is killed; a panic or an exception in it
comes back as one line. Either is a ``HetquantError`` naming tokenizer.json and the fix.

The ids are the tokenizer's own: the child rebuilds it from ``Tokenizer.to_str()`` and encodes
each document whole, as ``tokenizer.encode(text).ids`` in this process would.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetquant.formats import HetquantError

from ._encode_worker import HEAD, write_frame

__all__ = ["BASE_S", "MIN_BYTES_PER_S", "BoundedEncoder"]

BASE_S = 30.0
MIN_BYTES_PER_S = 100_000.0
WORKER = Path(__file__).with_name("_encode_worker.py")
FIX = "use the tokenizer.json published with the checkpoint"


class BoundedEncoder:
    """``with BoundedEncoder(tokenizer) as encode: ids = encode(text)`` (module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._send(b"T", tokenizer.to_str().encode())

    def __enter__(self) -> BoundedEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the child (end of input; killed if it does not end at once)."""
        proc = self._proc
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __call__(self, text: str) -> list[int]:
        """The token ids of ``text``, or a HetquantError (module docstring)."""
        data = text.encode("utf-8")  # documents() refused unpaired surrogates
        budget = BASE_S + len(data) / MIN_BYTES_PER_S
        self._send(b"D", data)
        tag, payload = self._receive(time.monotonic() + budget, budget, len(data))
        if tag == b"E":
            self.close()
            raise HetquantError(
                f"tokenizer.json: the tokenizer failed on the text ({payload.decode(errors='replace')})"
                f"; a pre-tokenizer regex that backtracks catastrophically does this — {FIX}"
            )
        return np.frombuffer(payload, dtype="<i8").tolist()

    def _send(self, tag: bytes, payload: bytes) -> None:
        try:
            write_frame(self._proc.stdin, tag, payload)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError):
            raise self._ended() from None

    def _receive(self, deadline: float, budget: float, size: int) -> tuple[bytes, bytes]:
        head = self._read(HEAD.size, deadline, budget, size)
        tag, length = HEAD.unpack(head)
        return tag, self._read(length, deadline, budget, size)

    def _read(self, n: int, deadline: float, budget: float, size: int) -> bytes:
        """``n`` bytes from the child before ``deadline``; kills it past the deadline."""
        fd, out = self._proc.stdout.fileno(), bytearray()  # type: ignore[union-attr]
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._proc.kill()
                self.close()
                raise HetquantError(
                    f"tokenizer.json: encoding a {size:,}-byte document took over {budget:.0f} s "
                    f"(a real tokenizer needs well under 1 s per 100 kB); its pre-tokenizer regex "
                    f"backtracks catastrophically — {FIX}"
                )
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise self._ended()
            out += chunk
        return bytes(out)

    def _ended(self) -> HetquantError:
        self.close()
        return HetquantError(
            f"tokenizer.json: the tokenizer process ended (exit code {self._proc.returncode}) "
            f"while encoding; {FIX}"
        )
