"""The child process of ``calib/encoding.py``: encodes documents with an untrusted tokenizer.

Run as a script (``python _encode_worker.py``: no hetquant import, only ``tokenizers``). It reads
framed messages on stdin and answers on stdout; a frame is a tag byte, a little-endian uint64
length and the payload:

- in ``T``: the tokenizer (``Tokenizer.to_str()`` JSON); ``D``: a document, UTF-8;
- out ``I``: the document's token ids, little-endian int64; ``E``: why encoding failed, UTF-8
  (the tokenizers library raised, or panicked: an onig regex over its retry limit raises
  ``pyo3_runtime.PanicException``, a ``BaseException``). The child stops after an ``E``.

stderr is discarded by the parent: a Rust panic prints its message (and, with RUST_BACKTRACE, a
backtrace) there before Python sees it.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import BinaryIO

__all__ = ["read_frame", "write_frame"]

HEAD = struct.Struct("<cQ")


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """(tag, payload) of the next frame; None at end of stream."""
    head = stream.read(HEAD.size)
    if len(head) < HEAD.size:
        return None
    tag, size = HEAD.unpack(head)
    return tag, stream.read(size)


def write_frame(stream: BinaryIO, tag: bytes, payload: bytes) -> None:
    stream.write(HEAD.pack(tag, len(payload)) + payload)
    stream.flush()


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    from tokenizers import Tokenizer

    tokenizer = None
    while (frame := read_frame(stdin)) is not None:
        tag, payload = frame
        try:
            if tag == b"T":
                tokenizer = Tokenizer.from_str(payload.decode())
                continue
            ids = array("q", tokenizer.encode(payload.decode()).ids)  # type: ignore[union-attr]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a Rust panic is a BaseException
            lines = str(e).strip().splitlines() or [type(e).__name__]
            write_frame(stdout, b"E", f"{type(e).__name__}: {lines[0]}".encode())
            return
        if sys.byteorder != "little":
            ids.byteswap()
        write_frame(stdout, b"I", ids.tobytes())


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
