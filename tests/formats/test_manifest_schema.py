"""``formats/manifest_schema.py``: one manifest reader; a missing or wrong-typed field is one
HetquantError naming it (issue 25 §2); schema 3 names its file digest algorithm, and one this
hetquant does not know is refused (issue 30). The commands' side:
tests/convert/test_untrusted_artifacts.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hetquant.formats import HetquantError
from hetquant.formats.manifest_schema import check_manifest

ARTIFACT: dict[str, Any] = {
    "schema_version": 2,
    "complete": True,
    "recipe": {"name": "bf16", "options": {}},
    "source": {"path": "/src", "fingerprint": "ab", "dtypes": {"embed": "BF16"}, "revision": None},
    "max_shard_size": 5,
    "parts": {"root": {"files": ["a.safetensors"]}},
    "files": {"a.safetensors": {"size": 8, "sha256": "00"}},
    "precision": {
        "groups": [{"name": "g", "format": "bf16", "params": 1, "bytes": 2, "bits_per_weight": 16}],
        "params": 1,
        "bytes": 2,
        "effective_bits_per_weight": 16.0,
    },
    "module_formats": {"m": {"format": "bf16", "params": {}, "shape": [1, 1]}},
    "accuracy": {"anything": [1, "goes"]},
}
EXPORT: dict[str, Any] = {
    "schema_version": 2,
    "complete": True,
    "export": {
        "to": "kt-amxint4",
        "numa": 1,
        "layers": [{"layer": 1, "file": "f", "prefix": "p", "fmt": "x", "params": {}}],
    },
    "source": {"path": "/art", "fingerprint": "ab"},
    "parts": {"kt-amxint4": {"files": []}},
    "files": {},
}


def _schema3(doc: dict, digest: str = "blake3") -> dict:
    """``doc`` as schema 3 writes it: ``file_digest`` named, every file's digest keyed by it."""
    files = {n: {"size": f["size"], digest: "ab" * 32} for n, f in doc["files"].items()}
    return {**doc, "schema_version": 3, "file_digest": digest, "files": files}


ARTIFACT3, EXPORT3 = _schema3(ARTIFACT), _schema3(EXPORT)


def test_valid_manifests_pass() -> None:
    for doc in (ARTIFACT, EXPORT, ARTIFACT3, EXPORT3, _schema3(ARTIFACT, "sha256")):
        check_manifest(doc, "m.json")


@pytest.mark.parametrize("digest", ["md5", "BLAKE3", "sha-256", 3, None, ["blake3"]])
def test_an_unknown_file_digest_is_refused_in_one_line(digest: Any) -> None:
    with pytest.raises(HetquantError) as e:
        check_manifest({**ARTIFACT3, "file_digest": digest}, "m.json")
    msg = str(e.value)
    assert msg.startswith("m.json: ") and "\n" not in msg
    assert "file_digest" in msg and ("blake3, sha256" in msg or "must be a string" in msg)


def test_a_schema_3_manifest_names_its_file_digest() -> None:
    with pytest.raises(HetquantError, match=r"m\.json: field file_digest is missing"):
        check_manifest({k: v for k, v in ARTIFACT3.items() if k != "file_digest"}, "m.json")
    # every file keyed by the algorithm named: a sha256 entry under blake3 is a missing digest
    with pytest.raises(HetquantError, match=r"files\['a\.safetensors'\]\.blake3 is missing"):
        check_manifest({**_schema3(ARTIFACT, "sha256"), "file_digest": "blake3"}, "m.json")
    # schemas 1 and 2 are sha256, whatever else they say
    with pytest.raises(HetquantError, match=r"files\['a\.safetensors'\]\.sha256 is missing"):
        check_manifest({**ARTIFACT3, "schema_version": 2}, "m.json")


def _edit(doc: dict, path: tuple, value: Any) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "path", "value", "named"),
    [
        (ARTIFACT, ("recipe",), None, "field recipe is missing"),
        (ARTIFACT, ("recipe", "options"), [], "field recipe.options must be a JSON object, not a list"),
        (ARTIFACT, ("source", "revision"), 3, "field source.revision must be a string or null, not 3"),
        (ARTIFACT, ("files", "a.safetensors", "size"), True, "field files['a.safetensors'].size must be a non-negative integer, not true"),
        (ARTIFACT, ("precision", "groups", 0, "bits_per_weight"), "16", "precision.groups[0].bits_per_weight must be a number"),
        (ARTIFACT, ("module_formats", "m", "shape", 1), -1, "module_formats['m'].shape[1]"),
        (ARTIFACT, ("complete",), 1, "field complete must be true or false, not 1"),
        (EXPORT, ("export", "layers", 0, "hidden_size"), 3, "export.layers[0].hidden_size is not a field"),
        (EXPORT, ("export", "numa"), None, "field export.numa is missing"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named(doc: dict, path: tuple, value: Any, named: str) -> None:
    with pytest.raises(HetquantError, match=r"^m\.json: ") as e:
        check_manifest(_edit(doc, path, value), "m.json")
    assert named in str(e.value) and "re-download" in str(e.value)


@pytest.mark.parametrize("version", [None, 4, "2", True, 2.0])
def test_unknown_schema_versions(version: Any) -> None:
    with pytest.raises(
        HetquantError, match=r"m\.json: (unknown manifest schema|field schema_version)"
    ):
        check_manifest({**ARTIFACT, "schema_version": version}, "m.json")


@pytest.mark.parametrize("doc", [[], "x", None, 3])
def test_not_an_object(doc: Any) -> None:
    with pytest.raises(HetquantError, match=r"m\.json: not a JSON object"):
        check_manifest(doc, "m.json")
