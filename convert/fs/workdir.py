"""The work directory ``OUTPUT/.hetquant-partial/``: journal, source identities, work files.

- ``journal``: first line ``plan <digest>``, then one finished job id per line, appended and
  flushed as jobs finish. Resume trusts a job only if the digest matches (same source index and
  config, recipe, options, layout), its files are intact (size and header as planned) and the
  source files it read still have the identity recorded in ``source.json``.
- ``source.json``: each source file's ``[size, mtime_ns, inode]`` when the work began.
- the containers, created at their final size and filled by jobs; then the artifact's other
  files and, last, its manifest: a complete artifact waiting to be moved into OUTPUT.
- ``lock`` (``lock.py``), which clearing the work directory keeps; and ``owned.json``
  (``engine/move.py``) while OUTPUT has no manifest: the files an unfinished move must still
  remove.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from hetquant.formats.filenames import MANIFEST_NAME

from .lock import LOCK_NAME
from .os_errors import naming
from .source_guard import Identity

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["JOURNAL", "OWNED", "WorkDir"]

JOURNAL = "journal"
OWNED = "owned.json"  # while a move into OUTPUT is unfinished: {"files": [names]} (engine/move.py)
SOURCE_IDS = "source.json"
_PLAN = "plan "


class WorkDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    def digest(self) -> str | None:
        """The plan digest of the work here (None: no journal)."""
        try:
            with open(self.path / JOURNAL) as f:
                first = f.readline().rstrip("\n")
        except FileNotFoundError:
            return None
        return first.removeprefix(_PLAN) if first.startswith(_PLAN) else None

    def start(self, digest: str, ids: dict[str, Identity]) -> None:
        """Begin new work: clear everything but the lock, write the journal header and ids."""
        self.clear()
        self._write(JOURNAL, f"{_PLAN}{digest}\n")
        self._write(SOURCE_IDS, json.dumps(ids, sort_keys=True) + "\n")

    def clear(self) -> None:
        keep = {LOCK_NAME} if (self.path.parent / MANIFEST_NAME).exists() else {LOCK_NAME, OWNED}
        for p in self.path.iterdir():
            if p.name in keep:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def recorded_ids(self) -> dict[str, Identity]:
        try:
            return json.loads((self.path / SOURCE_IDS).read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def done(self) -> set[int]:
        """Ids of the journaled jobs."""
        lines = (self.path / JOURNAL).read_text().splitlines()[1:]
        return {int(x) for x in lines if x.strip().isdigit()}

    def keep_only(self, digest: str, done: set[int], ids: dict[str, Identity]) -> None:
        """Rewrite the journal with just ``done`` (others are redone), then the identities."""
        lines = "".join(f"{i}\n" for i in sorted(done))
        self._write(JOURNAL, f"{_PLAN}{digest}\n{lines}")
        self._write(SOURCE_IDS, json.dumps(ids, sort_keys=True) + "\n")

    def open_files(self, plan: Plan, done: set[int]) -> set[int]:
        """Create every container that is missing or not intact; return the jobs of ``done``
        whose output files were intact (the others must run again)."""
        file_of = plan.file_of()
        created = set()
        for f in plan.files:
            if not f.intact(self.path / f.name):
                f.create(self.path / f.name)
                created.add(f.name)
        if created:  # one pass over the jobs (an export has tens of thousands of files)
            done -= {j.id for j in plan.jobs if any(file_of[o.tensor].name in created for o in j.outputs)}  # fmt: skip
        return done

    def _write(self, name: str, text: str) -> None:
        tmp = self.path / f".{name}.tmp"
        with naming(tmp), open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)
