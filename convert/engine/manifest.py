"""The artifact manifest ``hetquant.json``: written last, its ``complete: true`` makes an artifact.

It records the schema and hetquant versions, the resolved recipe, the source fingerprint (hash of
index + config, revision), the parts and their files, every file's size and digest (schema 3:
BLAKE3, named in ``file_digest``; schemas 1-2: sha256 — ``formats/file_digests.py``), the source
dtype of every role (so the plan can be replayed from the manifest alone), the precision table and
(schema 2) ``module_formats``: for every root-part module stored in a weight format, its
``{"format", "params", "shape"}`` — what the loader trusts instead of recognising formats; modules
it does not list are plain tensors. Schema-1 manifests (no ``module_formats``) still load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from hetquant.formats.base import identify
from hetquant.formats.file_digests import DIGESTS, FILE_DIGEST, DigestAlgorithm
from hetquant.formats.filenames import MANIFEST_NAME, READABLE_SCHEMAS
from hetquant.formats.safe_paths import open_binary

from ..fs.os_errors import naming
from ..planning.plan import JobKind, Plan
from ..recipes import ROOT

__all__ = [
    "HASH_READ",
    "MANIFEST_NAME",
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "build_manifest",
    "cores",
    "digest_files",
    "file_digest",
    "format_label",
    "format_precision",
    "hash_threads",
    "module_formats",
    "write_json_atomic",
]

SCHEMA_VERSION = 3  # 3: file digests are BLAKE3, named in ``file_digest``
# Hashing reads into one buffer that stays in the core's L2 cache while sha256 reads it back:
# beside 16 processes streaming memory one stream did 0.63 GB/s with 8 MB reads, 0.91 with 256 KB
# (benchmarks/probes/sha_speed.py, 16-core host; the convert's own tail did not move measurably).
HASH_READ = DIGESTS["sha256"].stream_read


def hetquant_version() -> str:
    try:
        return version("hetquant")
    except PackageNotFoundError:
        return "0+unknown"


def file_digest(
    path: Path, algorithm: DigestAlgorithm = DIGESTS[FILE_DIGEST], threads: int = 1
) -> dict[str, Any]:
    """Size and digest of a regular file, ``{"size": n, algorithm.name: hex}``, read into one
    buffer (``algorithm.bulk_read`` bytes when ``threads > 1`` share each read, else its
    ``stream_read``)."""
    h = algorithm.new(threads)
    buf = bytearray(algorithm.bulk_read if threads > 1 else algorithm.stream_read)
    view = memoryview(buf)
    with open_binary(path, buffering=0) as f:  # a FIFO or device is refused, never read
        while n := f.readinto(buf):
            h.update(view[:n])
        size = os.fstat(f.fileno()).st_size
    return {"size": size, algorithm.name: h.hexdigest()}


def cores() -> int:
    """The CPU cores this process may use."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return n or 1


def hash_threads(n: int | None = None) -> int:
    """Hashing threads (and files filled at once): the CPU cores this process may use (``n``),
    at least two, at most eight. Not fewer with fewer workers: then cores are idle, and more
    files at once multiply the streams of a hash that is one stream per file (sha256)."""
    return max(2, min(8, n or cores()))


def digest_files(
    paths: Mapping[str, Path],
    threads: int | None = None,
    algorithm: DigestAlgorithm = DIGESTS[FILE_DIGEST],
) -> dict[str, dict[str, Any]]:
    """``file_digest`` of every path, ``{name: digest}`` in the order given, several files at
    once (``hash_threads()`` by default; hashers and reads release the GIL), the largest first
    so that the last stream to end is a short one; each file's hash may itself use every core
    (BLAKE3: ``threads`` per file; the files beside it share them). The first OSError is
    raised."""
    if not paths:
        return {}
    size = {n: p.stat().st_size for n, p in paths.items()}
    order = sorted(paths, key=lambda n: -size[n])
    many = cores()  # threads on one file's hash: only for one that fills more than a read
    with ThreadPoolExecutor(threads or hash_threads(), thread_name_prefix="hetquant-digest") as ex:
        futures = {
            n: ex.submit(
                file_digest, paths[n], algorithm, many if size[n] > algorithm.bulk_read else 1
            )
            for n in order
        }
        return {n: futures[n].result() for n in paths}


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write JSON under a temporary name, fsync, rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with naming(tmp), open(tmp, "w") as f:  # EFBIG, ENOSPC from a write: no path
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def format_label(fmt: str) -> str:
    """A precision-table format as shown: ``+``-joined parts in one case, each named once.

    The table records a copied tensor by its stored dtype (``BF16``, ``F32``) and a converted one
    by its format name (``bf16``, ``w8a8_dynamic``); a BF16 copy and the ``bf16`` format are the
    same bytes, so both read ``bf16``.
    """
    return "+".join(sorted({part.lower() for part in fmt.split("+")}))


def format_precision(table: dict[str, Any]) -> str:
    """The precision table as aligned text; the format column is as wide as its longest entry."""
    labels = [format_label(g["format"]) for g in table["groups"]]
    w = max([len("format"), *map(len, labels)])
    lines = [f"{'group':<16} {'format':<{w}} {'params':>16} {'bytes':>16} {'bits/w':>7}"]
    for g, label in zip(table["groups"], labels, strict=True):
        lines.append(
            f"{g['name']:<16} {label:<{w}} {g['params']:>16,} {g['bytes']:>16,} {g['bits_per_weight']:>7.3f}"
        )
    lines.append(
        f"{'total':<16} {'':<{w}} {table['params']:>16,} {table['bytes']:>16,} {table['effective_bits_per_weight']:>7.3f}"
    )
    return "\n".join(lines)


def precision_table(plan: Plan) -> dict[str, Any]:
    """Per precision group: format(s), params, bytes, bits/weight; and the effective bits/weight.

    Params count every source tensor (dropped ones too, in format ``dropped``), so they add up to
    the source's parameter count; bytes count what the artifact stores.
    """
    item_of = {i.name: i for i in plan.items}
    job_of = {src: job for job in plan.jobs for src in job.sources}
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str) -> dict[str, Any]:
        item = item_of[name]
        key = "mtp" if item.role.mtp else item.role.role.group
        return groups.setdefault(key, {"name": key, "formats": set(), "params": 0, "bytes": 0})

    for item in plan.items:
        job = job_of.get(item.name)
        g = group(item.name)
        g["formats"].add(
            "dropped" if job is None else item.dtype if job.kind is JobKind.COPY else job.target.fmt
        )
        g["params"] += _numel(item.role.shape)
    for job in plan.jobs:
        group(job.source)["bytes"] += job.nbytes
    rows = []
    for g in groups.values():
        fmts = sorted(g.pop("formats"))
        rows.append(
            {
                "name": g["name"],
                "format": "+".join(fmts),
                **g,
                "bits_per_weight": round(8 * g["bytes"] / g["params"], 4),
            }
        )
    params = sum(r["params"] for r in rows)
    total = sum(r["bytes"] for r in rows)
    return {
        "groups": rows,
        "params": params,
        "bytes": total,
        "effective_bits_per_weight": round(8 * total / params, 4),
    }


def module_formats(plan: Plan) -> dict[str, dict[str, Any]]:
    """Module prefix → ``{"format", "params", "shape"}`` of every root-part module the plan
    stores in a weight format: quantized ones, and copies that are a format's stored tensors (a
    BF16 linear weight); plain copies (norms, biases) are left out."""
    out: dict[str, dict[str, Any]] = {}
    for job in plan.jobs:
        if job.target.part != ROOT:
            continue
        prefix, _, key = job.source.rpartition(".")
        if job.kind is JobKind.COPY:
            got = identify({key: job.outputs[0].meta}, name=job.source)
            if got is None or got.keys != {key}:
                continue
            fmt, shape = got.fmt, got.shape
        else:
            fmt = job.target.format()
            shape = plan.item(job.source).role.shape
        out[prefix] = {"format": fmt.name, "params": fmt.params, "shape": list(shape)}
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_manifest(
    plan: Plan,
    source: dict[str, Any],
    files: dict[str, dict[str, Any]],
    parts: dict[str, list[str]],
    plan_digest: str,
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "file_digest": FILE_DIGEST,
        "hetquant_version": hetquant_version(),
        "complete": True,
        "recipe": {"name": plan.recipe.name, "options": plan.recipe.options},
        "source": source,
        "max_shard_size": plan.max_shard_size,
        "plan_digest": plan_digest,
        "parts": {k: {"files": v} for k, v in parts.items()},
        "files": files,
        "precision": precision_table(plan),
        "module_formats": module_formats(plan),
    }
