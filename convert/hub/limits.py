"""The Hub's limits on an upload: ``check_hub_limits`` applies them before anything is sent.

Limits from hub-docs storage-limits.md (reference/hub_cli.md §1.8).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from hetquant.formats.filenames import INDEX_NAME, SINGLE_NAME

__all__ = [
    "FOLDER_ENTRIES_MAX",
    "HARD_FILE_BYTES",
    "PRIVATE_FREE_BYTES",
    "RECOMMENDED_FILE_BYTES",
    "REPO_FILES_RECOMMENDED",
    "LimitReport",
    "check_hub_limits",
]

# Hub limits (hub-docs storage-limits.md, Aug 2026; reference/hub_cli.md §1.8). Decimal units.
FOLDER_ENTRIES_MAX = 10_000  # hard: "the maximum number of files per folder cannot exceed 10k"
REPO_FILES_RECOMMENDED = 100_000
RECOMMENDED_FILE_BYTES = 200 * 10**9
HARD_FILE_BYTES = 500 * 10**9
PRIVATE_FREE_BYTES = 100 * 10**9  # private storage of a free account


@dataclass
class LimitReport:
    """What the Hub would refuse (``errors``) and what it advises against (``warnings``)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_hub_limits(
    sizes: dict[str, int], index: dict[str, Any] | None, *, private: bool = False
) -> LimitReport:
    """Check the files to upload (repo path → bytes) and the root index against the Hub's limits.

    ``index`` is the parsed ``model.safetensors.index.json`` (None when there is none).
    """
    rep = LimitReport()
    entries: set[PurePosixPath] = set()  # every file and every folder above one
    for name in sizes:
        p = PurePosixPath(name)
        entries.add(p)
        entries.update(q for q in p.parents if q != PurePosixPath("."))
    per_folder = Counter(str(e.parent) for e in entries)
    for folder, n in sorted(per_folder.items()):
        if n >= FOLDER_ENTRIES_MAX:
            rep.errors.append(
                f"{'the repository root' if folder == '.' else folder}: {n:,} entries; the Hub allows fewer than "
                f"{FOLDER_ENTRIES_MAX:,} per folder — split it into sub-folders"
            )
    if len(sizes) >= REPO_FILES_RECOMMENDED:
        rep.warnings.append(
            f"{len(sizes):,} files; the Hub recommends fewer than {REPO_FILES_RECOMMENDED:,} per repository"
        )
    for name, size in sorted(sizes.items()):
        if size > HARD_FILE_BYTES:
            rep.errors.append(
                f"{name}: {size / 1e9:,.1f} GB; the Hub refuses files over {HARD_FILE_BYTES / 1e9:.0f} GB — "
                "convert again with a smaller --max-shard-size"
            )
        elif size > RECOMMENDED_FILE_BYTES:
            rep.warnings.append(
                f"{name}: {size / 1e9:,.1f} GB; the Hub recommends files under {RECOMMENDED_FILE_BYTES / 1e9:.0f} GB"
            )
    rep.errors += _index_problems(sizes, index)
    total = sum(sizes.values())
    if private and total > PRIVATE_FREE_BYTES:
        rep.warnings.append(
            f"{total / 1e9:,.1f} GB private: a free account has {PRIVATE_FREE_BYTES / 1e9:.0f} GB of "
            "private storage (PRO/Team/Enterprise have more)"
        )
    return rep


def _index_problems(sizes: dict[str, int], index: dict[str, Any] | None) -> list[str]:
    root_shards = {n for n in sizes if "/" not in n and n.endswith(".safetensors")}
    if index is None:
        if len(root_shards) > 1 or (root_shards and root_shards != {SINGLE_NAME}):
            return [
                f"{INDEX_NAME} missing: root shards {', '.join(sorted(root_shards))} are unindexed"
            ]
        return []
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        return [f"{INDEX_NAME}: no weight_map"]
    named = {f for f in wm.values() if isinstance(f, str)}
    out = [
        f"{INDEX_NAME} names {f}, which is not among the files to upload"
        for f in sorted(named - set(sizes))
    ]
    out += [
        f"{f}: root shard not named in {INDEX_NAME} (the index does not cover it)"
        for f in sorted(root_shards - named)
    ]
    return out
