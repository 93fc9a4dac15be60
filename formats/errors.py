"""The one domain exception of hetquant.

Every bad input — a truncated shard, a scale of the wrong shape, a layout that would split a
quantization group — raises :class:`HetquantError` with a message that names the file or tensor,
what was expected, what was found and, where one exists, the fix. The CLI turns it into a single
``error: …`` line and exit code 2; library callers catch it like any exception.
"""

from __future__ import annotations

__all__ = ["HetquantError"]


class HetquantError(ValueError):
    """Bad input or an impossible request; the message names the culprit and the fix."""
