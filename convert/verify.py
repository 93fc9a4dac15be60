"""``hetquant verify``: an artifact checked against its manifest, byte for byte and shape for shape.

Checks, each reported as a line: the manifest is complete and of a known schema; every listed file
exists with its size and digest (the algorithm the manifest names: BLAKE3 on all cores since
schema 3, sha256 before; ``formats/file_digests.py``); nothing unlisted lies beside them but the user's documents
(``USER_DOCS``: a LICENSE, NOTES.txt, a README… — kept by ``convert --overwrite``, not part of the
artifact; ``publish`` uploads the licence files among them); every safetensors header is
valid; the index maps exactly the root shards' tensors; and every file's header is byte-identical
to the one the plan — replayed from config.json and the manifest's recipe and source dtypes —
prescribes, which proves every tensor's name, dtype, shape and offset — and every file that plan
writes is there, listed or not (a file deleted together with its manifest entry). An export (``hetquant
export``: another engine's layout) is checked the same way against the plan its manifest's
``export`` entry replays (``export.replay_export``): every file's size and header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError, get_format
from hetquant.formats.families import (
    TensorRole,
    expected_count,
    expected_tensors,
    load_config,
    load_json,
)
from hetquant.formats.file_digests import manifest_digest
from hetquant.formats.filenames import PARTIAL_DIR
from hetquant.formats.manifest_schema import read_manifest
from hetquant.formats.safe_paths import inside
from hetquant.formats.safetensors_io import read_header

from .engine.manifest import MANIFEST_NAME, digest_files, module_formats
from .export.plan import replay_export
from .planning.plan import Plan, SourceItem, make_plan
from .planning.source import INDEX_NAME, PLAIN
from .recipes import get_recipe

__all__ = [
    "USER_DOCS",
    "artifact_files",
    "count_files",
    "licence_files",
    "listed_files",
    "load_manifest",
    "replay_plan",
    "user_docs",
    "verify_artifact",
]

_FORMAT_OF_DTYPE = {"F8_E4M3": "fp8_block", "BF16": "bf16"}  # 2-D weights, schema-1 manifests
# Files a Hub repo adds beside the artifact (the card `publish` writes, git attributes, the
# download cache of huggingface_hub's local_dir mode): not part of the artifact, not checked.
HUB_FILES = {"README.md", ".gitattributes"}
# ... and the engine's scratch directory, which a kill between writing the manifest and removing
# it can leave behind (the next convert into OUTPUT removes it).
IGNORED_DIRS = (".cache/huggingface/", f"{PARTIAL_DIR}/")
# Documents a user keeps beside the artifact, by how their name starts (case-insensitive, in any
# folder): not part of it, not checked, kept by ``convert --overwrite``. The licence ones travel
# with a publish.
LICENCE_STEMS = ("LICENSE", "LICENCE", "COPYING", "NOTICE")
USER_DOCS = (*LICENCE_STEMS, "README", "NOTES", "AUTHORS", "CITATION", "CHANGELOG")


def _is_doc(name: str, stems: tuple[str, ...] = USER_DOCS) -> bool:
    return Path(name).name.upper().startswith(stems)


def user_docs(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The user's documents beside the artifact in ``root``: unlisted, named ``USER_DOCS*``."""
    return sorted(n for n in _unlisted(root, manifest) if _is_doc(n))


def licence_files(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The user's licence files beside the artifact (``LICENSE*``, ``COPYING*``, ...)."""
    return [n for n in user_docs(root, manifest) if _is_doc(n, LICENCE_STEMS)]


def _unlisted(root: Path, manifest: dict[str, Any]) -> set[str]:
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    on_disk = {n for n in on_disk if n not in HUB_FILES and not n.startswith(IGNORED_DIRS)}
    return on_disk - {MANIFEST_NAME} - set(manifest.get("files", {}))


def load_manifest(root: Path) -> dict[str, Any]:
    """``root``'s manifest, its schema checked (``formats.manifest_schema.read_manifest``)."""
    return read_manifest(root)


def source_format(manifest: dict[str, Any], role: TensorRole) -> str:
    """The source format of ``role``: recorded (``source.formats``), or for manifests written
    before it was, what its dtype meant then (FP8 blocks, BF16 linears, plain otherwise)."""
    src = manifest["source"]
    if "formats" in src:
        return src["formats"][role.role.name]
    dtype = src["dtypes"][role.role.name]
    return _FORMAT_OF_DTYPE.get(dtype, PLAIN) if len(role.shape) == 2 else PLAIN


def source_params(
    manifest: dict[str, Any], role: TensorRole, fmt: str
) -> tuple[tuple[str, Any], ...]:
    """The source format variant's parameters of ``role``, as the converter's plan held them:
    the format's defaults with the manifest's ``source.format_params`` (``finalize.
    source_variants``) over them; () for a plain tensor."""
    if fmt == PLAIN:
        return ()
    variant = (manifest["source"].get("format_params") or {}).get(role.role.name, {})
    return tuple(get_format(fmt, **variant).params.items())


def artifact_files(root: Path, manifest: dict[str, Any]) -> dict[str, int]:
    """The artifact's files, path → size: every file the manifest lists, and the manifest.

    The one definition that convert, inspect, verify and publish count and sum. Not included:
    what a Hub repo adds beside them (``HUB_FILES``: the card ``publish`` generates, ...).
    """
    files = {name: int(f["size"]) for name, f in listed_files(root, manifest).items()}
    files[MANIFEST_NAME] = (root / MANIFEST_NAME).stat().st_size
    return dict(sorted(files.items()))


def listed_files(root: Path, manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` (name → size and digest) and its parts' files, every name checked
    to stay inside ``root`` (``formats/safe_paths.py``; HetquantError for one that leaves it)."""
    listed: dict[str, dict[str, Any]] = manifest.get("files", {})
    parts = [p for p in (manifest.get("parts") or {}).values() if isinstance(p, dict)]
    for name in [*listed, *(f for part in parts for f in part.get("files", []))]:
        inside(root, name, root / MANIFEST_NAME)
    return listed


def count_files(files: dict[str, int]) -> str:
    """``"11 files, 5,958,355 bytes"``."""
    return f"{len(files)} files, {sum(files.values()):,} bytes"


def replay_plan(root: Path, manifest: dict[str, Any]) -> Plan:
    """The plan that produced the artifact, rebuilt from config.json and the manifest alone."""
    cfg = load_config(root / "config.json")
    _check_claims(root, manifest, expected_count(cfg))
    recipe = get_recipe(manifest["recipe"]["name"]).with_options(manifest["recipe"]["options"])
    dtypes = manifest["source"]["dtypes"]
    variants: dict[tuple[str, int], tuple[str, tuple[tuple[str, Any], ...]]] = {}
    items = []
    for name, role in expected_tensors(cfg).items():
        key = (role.role.name, len(role.shape))  # what source_format reads of the role
        if key not in variants:  # once per role, not per tensor (46k of them in the 671B)
            fmt = source_format(manifest, role)
            variants[key] = (fmt, source_params(manifest, role, fmt))
        items.append(SourceItem(name, role, dtypes[role.role.name], *variants[key]))
    return make_plan(items, recipe, manifest["max_shard_size"])


def _check_claims(root: Path, manifest: dict[str, Any], claimed: int) -> None:
    """Refuse a config.json that implies far more tensors than the artifact's safetensors files
    could hold, before the plan expands them (an edited config claiming 10⁶ experts). A stored
    tensor stands for at most one name, a stacked expert tensor [E, …] for at most 4 per expert;
    files missing or unreadable are counted as empty (verify reports them)."""
    capacity = 1024
    for name in manifest["files"]:
        path = inside(root, name, root / MANIFEST_NAME, "file")
        if not name.endswith(".safetensors") or not path.is_file():
            continue
        try:
            entries = read_header(path).entries.values()
        except HetquantError:
            continue
        # a stacked tensor holds at most 4 per expert it has bytes for: none where it has none
        capacity += sum(4 * e.shape[0] if len(e.shape) >= 3 and e.end > e.start else 1 for e in entries)  # fmt: skip
    if claimed > capacity:
        raise HetquantError(
            f"{root / 'config.json'}: implies {claimed:,} tensors, more than the artifact's "
            f"files hold ({capacity:,} at most); the artifact does not match its config.json — "
            "re-download it or re-run the conversion"
        )


def verify_artifact(root: Path) -> list[str]:
    """Every problem found (empty: the artifact is intact).

    A directory without a manifest is not an artifact (HetquantError: bad input); a manifest that
    is there but unreadable is a failed check.
    """
    if not (root / MANIFEST_NAME).exists():
        raise HetquantError(f"{root}: no {MANIFEST_NAME}; not a (complete) hetquant artifact")
    try:
        manifest = load_manifest(root)
    except HetquantError as e:
        return [str(e)]
    problems: list[str] = []
    if manifest.get("complete") is not True:
        problems.append(f"{MANIFEST_NAME}: not marked complete")
    listed = listed_files(root, manifest)  # a name outside the artifact: refused (exit 2)
    present = {name: root / name for name in listed if (root / name).is_file()}
    alg = manifest_digest(manifest, MANIFEST_NAME)  # known: read_manifest checked it
    digests = digest_files(present, algorithm=alg)  # several files at once, each on all cores
    for name, want in listed.items():
        if name not in digests:
            there = (root / name).exists()  # a FIFO, a device, a directory: never opened
            problems.append(f"{name}: {'not a regular file' if there else 'missing'}")
            continue
        got = digests[name]
        if got["size"] != want["size"]:
            problems.append(f"{name}: size {got['size']} != {want['size']} in the manifest")
        elif got[alg.name] != want[alg.name]:
            problems.append(f"{name}: {alg.name} differs from the manifest (corrupt or modified)")
    unlisted = sorted(n for n in _unlisted(root, manifest) if not _is_doc(n))
    problems += [f"{n}: not listed in the manifest" for n in unlisted]
    problems += _check_structure(root, manifest)
    return problems


def _check_structure(root: Path, manifest: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    try:  # an export (``hetquant export``) records its own plan; an artifact, its recipe's
        plan = replay_export(manifest) if "export" in manifest else replay_plan(root, manifest)
    except (HetquantError, KeyError, TypeError) as e:
        return [f"cannot replay the plan from the manifest: {e}"]
    listed = manifest["files"]
    for f in plan.files:
        if (root / f.name).is_file():  # a missing one is already reported
            problems += f.check(root / f.name)  # its container's structure (e.g. the header)
        elif f.name not in listed:  # gone, and dropped from the manifest too
            problems.append(
                f"{f.name}: missing and not listed in the manifest, but the plan replayed from "
                "config.json and the manifest's recipe writes it"
            )
    if "export" in manifest:  # another engine's layout: no index, no root part
        return problems
    try:  # a corrupt index is a failed check (exit 1), not bad input
        index = load_json(root / INDEX_NAME) if (root / INDEX_NAME).exists() else {}
    except HetquantError as e:
        return [*problems, f"{INDEX_NAME}: {e}"]
    if "module_formats" in manifest and manifest["module_formats"] != module_formats(plan):
        problems.append(f"{MANIFEST_NAME}: module_formats differ from the plan's formats")
    want_map = {t.name: f.name for f in plan.files if f.part == "root" for t in f.tensors}
    if not isinstance(index, dict) or index.get("weight_map") != want_map:
        problems.append(f"{INDEX_NAME}: weight_map does not match the root shards")
    return problems
