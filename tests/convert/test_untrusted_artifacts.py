"""Untrusted artifacts through every command that reads one (issue 25 §2): what does not match is
refused, never loaded silently, and never with a traceback.

- a deeply nested JSON (the manifest, config.json, a shard's header) and every wrong-typed or
  missing manifest field: exit 2 and one ``error:`` line naming the file and field — or, in
  ``verify`` and ``publish`` (which verifies first), a failed check (exit 1, ``FAIL`` lines);
- overlapping tensor offsets in a shard's header;
- stored shapes that disagree with config.json (a norm, a CPU expert layer, an edited config);
- a cpu_experts file deleted together with its manifest entry: ``verify`` reports it.

The hybrid artifact serves every case: it has a root part and a ``cpu_experts`` part, so
``export`` reads it too. Shards are hard links to the session's artifact and are only ever
replaced, never written in place.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import MANIFEST, drop_listed_file, error_line, read_json, st_header, write_json

LAYER2 = "cpu_experts/layer_002.safetensors"
SHARD = "model-00001-of-00001.safetensors"
DEEP = 100_000  # levels: past any recursion limit
CHECKS = ("verify", "publish")  # bad input is a failed check there (exit 1, FAIL lines)
COMMANDS = ("inspect", "verify", "run", "publish", "export", "eval")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "held-out.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


def _args(command: str, art: Path, tmp_path: Path, tiny_ro: Path, text: Path) -> list[Any]:
    extra = {
        "run": ["--tokens", "1,2,3"],
        "publish": ["acme/x", "--dry-run", "--license", "mit"],
        "export": [tmp_path / "out", "--to", "kt-amxint4"],
        "eval": ["--reference", tiny_ro, "--text", text, "--samples", 1, "--seq-len", 8],
    }
    return [command, art, *extra.get(command, [])]


def _copy(src: Path, tmp_path: Path) -> Path:
    """``src`` copied, its safetensors files hard-linked (edits replace them: ``_replace``)."""

    def link_or_copy(a: str, b: str) -> None:
        os.link(a, b) if a.endswith(".safetensors") else shutil.copy2(a, b)

    dst = tmp_path / "art"
    shutil.copytree(src, dst, copy_function=link_or_copy)
    return dst


def _replace(path: Path, data: bytes) -> None:
    path.unlink()  # a new inode: the linked original stays as it was
    path.write_bytes(data)


def _refused(res: Any, command: str, *needles: str) -> None:
    out = res.stdout + res.stderr
    assert res.exception is None and "Traceback" not in out, out
    if command in CHECKS:
        assert res.exit_code == 1, (res.exit_code, out)
        fails = [x for x in res.stdout.splitlines() if x.startswith("FAIL ")]
        assert any(all(n in x for n in needles) for x in fails), (needles, out)
    else:
        assert res.exit_code == 2, (res.exit_code, out)
        line = error_line(res.stderr)
        assert all(n in line for n in needles), (needles, line)


# ----------------------------------------------------------------------------------------------
# deeply nested JSON


def _nested(key: str) -> str:
    return f'"{key}": ' + "[" * DEEP + "]" * DEEP


def deep_manifest(art: Path) -> None:  # ``accuracy`` is free-form: the model card prints it
    doc = json.dumps(read_json(art / MANIFEST))
    (art / MANIFEST).write_text(doc[:-1] + ", " + _nested("accuracy") + "}")


def deep_config(art: Path) -> None:
    doc = json.dumps(read_json(art / "config.json"))
    (art / "config.json").write_text(doc[:-1] + ", " + _nested("notes") + "}")


def deep_header(art: Path) -> None:
    start, header = st_header(art / SHARD)
    body = json.dumps(header)[:-1] + ", " + _nested("junk") + "}"
    data = (art / SHARD).read_bytes()[start:]
    _replace(art / SHARD, struct.pack("<Q", len(body)) + body.encode() + data)


DEEP_CASES = {  # edit, the file named, commands that never read that file
    "manifest": (deep_manifest, MANIFEST, ()),
    "config": (deep_config, "config.json", ("inspect",)),
    "header": (deep_header, SHARD, ("inspect",)),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(DEEP_CASES))
def test_deeply_nested_json_is_refused(
    cli, tiny_hybrid: Path, tiny_ro: Path, text: Path, tmp_path: Path, case: str, command: str
) -> None:
    edit, file, unread = DEEP_CASES[case]
    if command in unread:
        pytest.skip(f"{command} does not read {file}")
    art = _copy(tiny_hybrid, tmp_path)
    edit(art)
    res = cli(*_args(command, art, tmp_path, tiny_ro, text))
    _refused(res, command, file, "nested more than")


# ----------------------------------------------------------------------------------------------
# manifest fields missing or of the wrong type

GONE = object()
FIELDS: list[tuple[tuple[str, ...], Any]] = [
    (("schema_version",), GONE),
    (("schema_version",), "2"),
    (("complete",), "yes"),
    (("recipe",), GONE),
    (("recipe",), "ascend-hybrid"),
    (("recipe", "name"), 3),
    (("recipe", "options"), []),
    (("source",), None),
    (("source", "path"), GONE),
    (("source", "fingerprint"), 12),
    (("source", "dtypes"), "BF16"),
    (("source", "revision"), ["abc"]),
    (("max_shard_size",), "5GB"),
    (("parts",), []),
    (("parts", "cpu_experts", "files"), LAYER2),
    (("parts", "root"), {"file": []}),
    (("files",), GONE),
    (("files",), ["config.json"]),
    (("files", "config.json", "size"), "1472"),
    (("files", "config.json", "blake3"), GONE),
    (("file_digest",), "md5"),
    (("precision",), GONE),
    (("precision", "groups"), {}),
    (("precision", "groups", 0, "params"), -1),
    (("precision", "effective_bits_per_weight"), "4.5"),
    (("module_formats",), []),
    (("module_formats", "model.layers.0.self_attn.o_proj", "shape"), "[256, 128]"),
    (("hetquant_version",), 0.1),
]


def _set_field(art: Path, path: tuple[Any, ...], value: Any) -> None:
    doc = read_json(art / MANIFEST)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is GONE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    write_json(art / MANIFEST, doc)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("path", "value"), FIELDS, ids=[".".join(map(str, p)) + ("-gone" if v is GONE else "") for p, v in FIELDS]
)  # fmt: skip
def test_manifest_fields_are_checked(
    cli, tiny_hybrid: Path, tiny_ro: Path, text: Path, tmp_path: Path, command: str, path, value
) -> None:
    art = _copy(tiny_hybrid, tmp_path)
    _set_field(art, path, value)
    res = cli(*_args(command, art, tmp_path, tiny_ro, text))
    needle = "schema" if path == ("schema_version",) else "field "
    leaf = next((k for k in reversed(path) if isinstance(k, str) and "." not in k), path[0])
    _refused(res, command, MANIFEST, needle, str(leaf) if needle == "field " else "")


# ----------------------------------------------------------------------------------------------
# overlapping offsets, shapes that disagree with config.json, a layer file gone


def overlap(art: Path) -> None:
    """lm_head's data_offsets pointed at the embedding's bytes (same dtype and shape)."""
    start, header = st_header(art / SHARD)
    header["lm_head.weight"]["data_offsets"] = header["model.embed_tokens.weight"]["data_offsets"]
    body = json.dumps(header, separators=(",", ":")).ljust(start - 8).encode()
    _replace(
        art / SHARD, (art / SHARD).read_bytes()[:8] + body + (art / SHARD).read_bytes()[start:]
    )


def fewer_experts(art: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {k: v[:4].clone() for k, v in load_file(str(art / LAYER2)).items()}
    (art / LAYER2).unlink()
    save_file(tensors, str(art / LAYER2))


def drop_layer_file(art: Path) -> None:
    """A cpu_experts layer file deleted, and dropped from the manifest too."""
    drop_listed_file(art, LAYER2)


def _config(**changes: Any) -> Callable[[Path], None]:
    def edit(art: Path) -> None:
        write_json(art / "config.json", {**read_json(art / "config.json"), **changes})

    return edit


MISMATCHES = {  # edit, what the line names (verify's: when it differs)
    "overlap": (overlap, ("lm_head.weight", "overlaps"), None),
    "fewer-experts": (fewer_experts, ("model.layers.2.mlp.experts.4", "which no file"), (LAYER2,)),
    "layer-file-gone": (drop_layer_file, ("model.layers.2.mlp.experts.0", "which no file"),
                        (LAYER2, "missing and not listed")),
    "vocab": (_config(vocab_size=600), ("embed_tokens", "[640, 256]", "[600, 256]"), ("config.json",)),
    "layers": (_config(num_hidden_layers=2), ("config.json",), ("config.json",)),
}  # fmt: skip


@pytest.mark.parametrize("command", ["verify", "run", "publish", "export"])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_what_disagrees_with_config_is_refused(
    cli, tiny_hybrid: Path, tiny_ro: Path, text: Path, tmp_path: Path, case: str, command: str
) -> None:
    edit, needles, check_needles = MISMATCHES[case]
    art = _copy(tiny_hybrid, tmp_path)
    edit(art)
    res = cli(*_args(command, art, tmp_path, tiny_ro, text))
    _refused(res, command, *((check_needles or needles) if command in CHECKS else needles))
    assert not (tmp_path / "out" / MANIFEST).exists()
