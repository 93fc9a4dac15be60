"""The move of a complete artifact from the work directory into OUTPUT (the last step of a
convert or export held as a transaction: ``transaction.py``).

Planned from the new manifest and the files hetquant wrote before (OUTPUT's manifest, or what an
interrupted move recorded: ``OWNED``; the rest is the user's, kept); validated before anything
changes (``check_move``; before the jobs, without contents: ``check_target``): no file of the
user's replaced by another, nothing where a file or directory must go, a probe renamed into every
receiving directory (EXDEV); executed as: names recorded, old manifest removed, new files renamed
in, files only the old artifact had removed, the new manifest last. A kill leaves no manifest;
re-running the same command finishes the move.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.file_digests import DIGESTS
from hetquant.formats.filenames import MANIFEST_NAME, PARTIAL_DIR

from ..fs.workdir import OWNED
from .manifest import file_digest, write_json_atomic

__all__ = ["check_move", "check_target", "move_in", "owned_files"]

_PROBE = ".hetquant-probe"
Want = Mapping[str, Any] | Path | None  # what a new file will be (see ``_differs``)


def owned_files(out: Path) -> set[str]:
    """The files hetquant wrote into ``out`` (relative names): those its manifest lists, or,
    while a move is unfinished, those it recorded (``OWNED``); and the manifest."""
    for path in (out / MANIFEST_NAME, out / PARTIAL_DIR / OWNED):
        files = _listed(path)
        if files is not None:
            return {n for n in files if _relative(n)} | {MANIFEST_NAME}
    return {MANIFEST_NAME}


def _relative(name: str) -> bool:
    """Whether ``name`` (from a manifest: untrusted) names a path below OUTPUT: not absolute,
    no ``..``."""
    rel = Path(name)
    return bool(rel.parts) and not rel.is_absolute() and ".." not in rel.parts


def _listed(path: Path) -> set[str] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    return {n for n in files if isinstance(n, str)} if isinstance(files, dict | list) else None


def check_target(out: Path, work: Path, names: Mapping[str, Path | None]) -> None:
    """Before the jobs: refuse what ``check_move`` would refuse of the files ``names`` (name →
    the file it will be a copy of, None: bytes not known yet)."""
    _check(out, work, {**names, MANIFEST_NAME: None}, owned_files(out))


def check_move(out: Path, work: Path, new: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse, changing nothing, a move of ``new`` (name → size and digest) into ``out``; files
    an interrupted earlier move already took out of ``work`` are in place, not checked."""
    left = {n: d for n, d in new.items() if os.path.lexists(work / n)}
    _check(out, work, left | {MANIFEST_NAME: None}, owned_files(out))


def _check(out: Path, work: Path, new: Mapping[str, Want], owned: set[str]) -> None:
    clash = [n for n in sorted(new) if n not in owned and _differs(out / n, new[n])]
    if clash:
        shown = ", ".join(clash[:5]) + (f" and {len(clash) - 5} more" if len(clash) > 5 else "")
        raise HetquantError(
            f"OUTPUT {out}: {shown} {'is' if len(clash) == 1 else 'are'} not part of the artifact "
            "there, and the new artifact writes the same name; move it away, then re-run the same "
            "command (nothing in OUTPUT was changed)"
        )
    for d in sorted({_existing_parent(out, n) for n in new}):
        _probe_rename(out, work, d)


def _differs(path: Path, want: Want) -> bool:
    """Whether a file of the user's at ``path`` would be lost by writing ``want`` there: a
    manifest's size and digest (of any known algorithm: a work directory's manifest may be an
    older hetquant's), a file of the same bytes, or None (not known: any file)."""
    if not os.path.lexists(path):
        return False
    if isinstance(want, Path):
        want = file_digest(want)
    if want is None or not path.is_file() or path.stat().st_size != want.get("size"):
        return True
    alg = next((DIGESTS[k] for k in want if k in DIGESTS), None)
    return alg is None or file_digest(path, alg)[alg.name] != want[alg.name]


def _existing_parent(out: Path, name: str) -> Path:
    """The directory that receives ``name``, or its nearest existing ancestor."""
    d = (out / name).parent
    while d != out and not d.exists():
        d = d.parent
    if d.exists() and not d.is_dir():
        raise HetquantError(
            f"OUTPUT {out}: {d} is a file where the new artifact needs a directory; move it away "
            "(nothing in OUTPUT was changed)"
        )
    return d


def _probe_rename(out: Path, work: Path, target: Path) -> None:
    """Rename an empty file from ``work`` into ``target`` and back: the move's renames work."""
    src, dst = work / _PROBE, target / _PROBE
    src.touch()
    try:
        os.rename(src, dst)
    except OSError as e:
        src.unlink()
        if e.errno != errno.EXDEV:
            raise OSError(e.errno, e.strerror, str(target)) from None
        raise HetquantError(
            f"OUTPUT {out}: {target} is on another file system than OUTPUT (a symbolic link?), "
            "and finished files are moved in by rename, which cannot cross file systems; make it "
            "a directory on OUTPUT's file system, or convert into another OUTPUT (nothing in "
            "OUTPUT was changed)"
        ) from None
    os.rename(dst, src)
    src.unlink()


def move_in(out: Path, work: Path) -> dict[str, Any]:
    """Replace the artifact in ``out`` by the complete one in ``work`` (module docstring)."""
    manifest = json.loads((work / MANIFEST_NAME).read_text())
    new = manifest["files"]
    owned = owned_files(out)
    check_move(out, work, new)
    write_json_atomic(work / OWNED, {"files": sorted(owned | set(new))})
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for name in sorted(new):
        if (work / name).exists():  # else moved by an interrupted earlier move_in
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(work / name, out / name)
    _remove(out, owned - set(new) - {MANIFEST_NAME})
    os.replace(work / MANIFEST_NAME, out / MANIFEST_NAME)
    (work / OWNED).unlink()
    _fsync_dir(out)
    return manifest


def _remove(out: Path, names: set[str]) -> None:
    """Delete the files ``names`` and hetquant's temporary names of them, then the directories
    this left empty (a directory holding a file of the user's stays); nothing where a linked
    directory leads out of ``out``."""
    dirs, root = set(), out.resolve()
    for name in sorted(names):
        if not (out / name).parent.resolve().is_relative_to(root):
            continue  # a linked directory leads out of OUTPUT: never delete there
        for p in (out / name, (out / name).with_name(f".{Path(name).name}.tmp")):
            if p.is_symlink() or p.is_file():
                p.unlink()
        dirs.update(d for d in (out / name).parents if d.is_relative_to(out) and d != out)
    for d in sorted(dirs, key=lambda d: -len(d.parts)):  # children before their parents
        if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
