"""The algorithms a manifest's file digests are computed with: a registry, name → hasher.

Schema 3 manifests name theirs in ``file_digest`` and key every file's digest by that name
(``{"size": 123, "blake3": "<hex>"}``); schemas 1 and 2 have no such field and are ``sha256``.

- ``blake3`` (written since schema 3): a tree hash, so one file's bytes can be hashed on many
  threads (``threads > 1``: a rayon pool of that many threads owned by the hasher, gone with it),
  and ~3× sha256's speed on one core (benchmarks/notes/convert-scaling.md, "The hash tail").
  Check a file by hand with ``b3sum FILE`` (the ``b3sum`` crate / package).
- ``sha256`` (schemas 1 and 2; still verified): one sequential stream, ~1 GB/s per file even
  with SHA-NI; ``sha256sum FILE``. The Hub's LFS wants sha256 and computes it itself on upload.

Only this module imports ``blake3``, and only when a blake3 hasher is made: readers of a manifest
(the loader, the vLLM plugin) never hash and need not have it installed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import HetquantError

__all__ = [
    "DIGESTS",
    "FILE_DIGEST",
    "LEGACY_FILE_DIGEST",
    "DigestAlgorithm",
    "Hasher",
    "get_digest",
    "manifest_digest",
]

FILE_DIGEST = "blake3"  # what convert and export write (schema 3)
LEGACY_FILE_DIGEST = "sha256"  # schemas 1 and 2, which do not name it


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...
    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class DigestAlgorithm:
    """One file digest algorithm.

    ``new(threads)``: a fresh hasher that may use up to ``threads`` threads on one update.
    ``stream_read``: bytes per read while hashing a file that is still being written (the
    convert's hashing threads: the jobs own the cores); ``bulk_read``: bytes per read of a whole
    file on all threads (the convert's tail, ``verify``) — large enough to spread over them.
    """

    name: str
    new: Callable[[int], Hasher]
    stream_read: int
    bulk_read: int


def _sha256(threads: int) -> Hasher:  # one stream whatever ``threads``
    return hashlib.sha256()


def _blake3(threads: int) -> Hasher:
    try:
        from blake3 import blake3
    except ImportError as e:  # a declared dependency; a hand-made environment may lack it
        raise HetquantError(
            f"hashing with blake3 needs the blake3 package ({e}); pip install 'blake3>=1.0'"
        ) from None
    return blake3(max_threads=max(1, threads))  # >1: a pool owned by this hasher


# sha256 reads 256 KB into a buffer that stays in L2 (benchmarks/notes/convert-scaling.md); a
# blake3 update under ~1 MB costs more CPU on a thread pool than it gains (same note).
DIGESTS: dict[str, DigestAlgorithm] = {
    "sha256": DigestAlgorithm("sha256", _sha256, 256 << 10, 256 << 10),
    "blake3": DigestAlgorithm("blake3", _blake3, 1 << 20, 16 << 20),
}


def get_digest(name: Any, origin: str) -> DigestAlgorithm:
    """The algorithm called ``name``; a HetquantError (one line, naming ``origin``) if unknown."""
    if isinstance(name, str) and name in DIGESTS:
        return DIGESTS[name]
    raise HetquantError(
        f"{origin}: unknown file digest algorithm {name!r}; this hetquant knows "
        f"{', '.join(sorted(DIGESTS))} — use the hetquant version that wrote the artifact"
    )


def manifest_digest(doc: dict[str, Any], origin: str) -> DigestAlgorithm:
    """The algorithm of a manifest's file digests: sha256 for schemas 1 and 2, else the one its
    ``file_digest`` names (HetquantError if unknown or missing)."""
    if doc.get("schema_version") in (1, 2):
        return DIGESTS[LEGACY_FILE_DIGEST]
    return get_digest(doc.get("file_digest"), f"{origin}: field file_digest")
