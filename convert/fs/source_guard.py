"""The source must not change under a convert: each file's identity, recorded and checked.

A shard's identity is ``(size, mtime_ns, inode)``: a truncation, an edit in place (even one that
leaves valid FP8 bytes behind) or a replacement (a re-download renames a new file over the old
one) each change it. The engine records the identities of every shard and of config.json and the
index when it plans; jobs check the files they read before and after running, and the whole
source is checked once more before the manifest is written. A change is one error line, and no
manifest. On resume, jobs that read a file whose identity differs from the recorded one are
redone (the plan digest covers only index + config, whose bytes fix the layout).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetquant.formats import HetquantError
from hetquant.formats.filenames import INDEX_NAME

if TYPE_CHECKING:
    from ..planning.plan import Job

__all__ = ["SourceGuard", "job_files", "source_files"]

Identity = list[int]  # [size, mtime_ns, inode]; a list, as it round-trips through JSON


def source_files(source: Any) -> list[str]:
    """The files of ``source`` a convert reads: its shards, config.json and the index."""
    meta = [n for n in ("config.json", INDEX_NAME) if (Path(source.root) / n).is_file()]
    return sorted({*source.shard_files, *meta})


def job_files(source: Any, job: Job) -> set[str]:
    """The source files ``job`` reads (every stored tensor of its sources' modules and of the
    partners whose absmax it takes: weights and their scales, which may live in other shards)."""
    names = (*job.sources, *job.amax_group)  # a merged module's partners: their absmax
    return {file for name in names for file, _ in source.tensors[name].parts.values()}


def _identity(path: Path) -> Identity | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


@dataclass(frozen=True)
class SourceGuard:
    """Identities of the files under ``root`` as recorded when the convert planned."""

    root: Path
    ids: dict[str, Identity]

    @classmethod
    def record(cls, source: Any) -> SourceGuard:
        return cls.of_files(Path(source.root), source_files(source))

    @classmethod
    def of_files(cls, root: Path, names: list[str]) -> SourceGuard:
        """The identities of ``names`` under ``root`` now (an export's source files)."""
        ids = {n: _identity(root / n) for n in names}
        return cls(root, {n: i for n, i in ids.items() if i is not None})

    def changed(self, files: set[str] | None = None) -> dict[str, str]:
        """File → what changed, for ``files`` (default: all recorded) that differ now."""
        out = {}
        for name in sorted(self.ids if files is None else files):
            now, then = _identity(self.root / name), self.ids.get(name)
            if now != then:
                out[name] = _what_changed(then, now)
        return out

    def check(self, files: set[str] | None = None) -> None:
        """Raise the one-line error if any of ``files`` (default: all) changed."""
        if changed := self.changed(files):
            raise HetquantError(self.message(changed))

    def message(self, changed: dict[str, str]) -> str:
        name, what = next(iter(changed.items()))
        more = f" (and {len(changed) - 1} more file(s))" if len(changed) > 1 else ""
        return (
            f"SOURCE changed during conversion: {self.root / name} {what}{more}; no manifest was "
            "written — once the source is complete and stable, re-run the same command (the jobs "
            "that read changed files are redone)"
        )


def _what_changed(then: Identity | None, now: Identity | None) -> str:
    if then is None:
        return "appeared"
    if now is None:
        return "was removed"
    if now[2] != then[2]:
        return "was replaced by another file"
    if now[0] != then[0]:
        return f"changed size from {then[0]:,} to {now[0]:,} bytes"
    return "was modified (mtime)"
