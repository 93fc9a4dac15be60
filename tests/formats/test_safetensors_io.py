"""formats/safetensors_io.py: golden bytes of the header-first writer, interoperability with the
safetensors library, and every way a corrupt header is refused."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hetquant.formats import HetquantError, TensorMeta
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.safetensors_io import (
    MappedFile,
    build_header,
    create_file,
    read_header,
    write_at,
)

# ----------------------------------------------------------------------------------------------
# golden bytes: one I32 [2] and one BF16 [1], metadata {"format": "pt"}

GOLDEN_JSON = (
    b'{"__metadata__":{"format":"pt"},'
    b'"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},'
    b'"b":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]}}'
)  # 140 bytes; 8 + 140 = 148 → 4 spaces of padding to 152, a multiple of 8
GOLDEN_HEADER = b"\x90\x00\x00\x00\x00\x00\x00\x00" + GOLDEN_JSON + b"    "  # N = 144 = 0x90
GOLDEN_DATA = (
    b"\x01\x00\x00\x00"  # a[0] = 1      (int32 little-endian)
    b"\xfe\xff\xff\xff"  # a[1] = -2
    b"\x80\x3f"  # b[0] = 1.0 (bf16 0x3F80, little-endian)
)
GOLDEN_TENSORS = [("a", TensorMeta("I32", (2,))), ("b", TensorMeta("BF16", (1,)))]


def test_build_header_golden_bytes() -> None:
    assert len(GOLDEN_JSON) == 140
    header = build_header(GOLDEN_TENSORS, {"format": "pt"})
    assert header == GOLDEN_HEADER
    assert len(header) % 8 == 0


def test_build_header_without_metadata_has_no_metadata_key() -> None:
    header = build_header([("x", TensorMeta("U8", (3,)))], {})
    (n,) = struct.unpack("<Q", header[:8])
    assert header[8:] == b'{"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}' + b" " * (n - 53)
    assert len(header) % 8 == 0


def _write_golden(path: Path, order: str = "ab") -> None:
    header = build_header(GOLDEN_TENSORS, {"format": "pt"})
    create_file(path, header, 10)
    assert path.read_bytes() == GOLDEN_HEADER + b"\0" * 10  # sized, zero-filled
    fd = os.open(path, os.O_WRONLY)
    try:
        writes = {
            "a": lambda: write_at(fd, len(header), torch.tensor([1, -2], dtype=torch.int32)),
            "b": lambda: write_at(fd, len(header) + 8, torch.tensor([1.0], dtype=torch.bfloat16)),
        }
        for k in order:
            writes[k]()
    finally:
        os.close(fd)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_create_and_write_at_golden_bytes(tmp_path: Path, order: str) -> None:
    path = tmp_path / "g.safetensors"
    _write_golden(path, order)
    assert path.read_bytes() == GOLDEN_HEADER + GOLDEN_DATA


def test_golden_file_is_readable_by_the_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    _write_golden(path)
    tensors = load_file(path)
    assert tensors.keys() == {"a", "b"}
    assert tensors["a"].dtype == torch.int32 and tensors["a"].tolist() == [1, -2]
    assert tensors["b"].dtype == torch.bfloat16 and tensors["b"].tolist() == [1.0]
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == ["a", "b"]
        assert f.get_slice("a").get_shape() == [2]
        assert f.get_tensor("b").tolist() == [1.0]
    h = read_header(path)
    assert [(e.name, e.dtype, e.shape, e.start, e.end) for e in h.entries.values()] == [
        ("a", "I32", (2,), 152, 160),
        ("b", "BF16", (1,), 160, 162),
    ]
    assert h.metadata == {"format": "pt"} and h.data_start == 152 and h.file_size == 162


def test_write_at_bytes_and_non_contiguous_tensors(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 16)
    fd = os.open(path, os.O_WRONLY)
    try:
        write_at(fd, 2, b"\x01\x02")
        t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()  # non-contiguous: 0 3 1 4 2 5
        write_at(fd, 4, t)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0\0\x01\x02" + struct.pack("<6h", 0, 3, 1, 4, 2, 5)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.uint8,
          torch.float8_e4m3fn, torch.int64, torch.bool]  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31),
    metadata=st.dictionaries(st.text("abc", min_size=1, max_size=3), st.text(max_size=5)),
    data=st.data(),
)
def test_written_files_round_trip_through_the_library(
    tmp_path_factory: pytest.TempPathFactory, specs, seed, metadata, data
) -> None:
    """Any tensors, written piecewise in any order, load back identically with safetensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 8,), generator=g)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = raw.to(torch.uint8)[:n]
        if dtype == torch.bool:
            raw &= 1  # a bool byte is 0 or 1
        tensors[f"t{i}.weight"] = raw.view(dtype).reshape(shape)
    metas = [(k, TensorMeta(st_dtype(v.dtype), tuple(v.shape))) for k, v in tensors.items()]
    header = build_header(metas, metadata)
    path = tmp_path_factory.mktemp("rt") / "x.safetensors"
    create_file(path, header, sum(m.nbytes for _, m in metas))
    offsets, pos = {}, len(header)
    for k, m in metas:
        offsets[k], pos = pos, pos + m.nbytes
    fd = os.open(path, os.O_WRONLY)
    try:
        for k in data.draw(st.permutations(list(tensors))):
            write_at(fd, offsets[k], tensors[k])
    finally:
        os.close(fd)
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert _raw(back[k]) == _raw(v)
    with safe_open(path, framework="pt") as f:
        assert (f.metadata() or {}) == metadata
    h = read_header(path)
    mapped = MappedFile(path)
    for k, v in tensors.items():
        assert h.entries[k].start == offsets[k]
        assert _raw(mapped.view(h.entries[k])) == _raw(v)


def test_read_header_agrees_with_the_library_on_its_files(tmp_path: Path) -> None:
    tensors = {
        "z": torch.ones(3, 5, dtype=torch.bfloat16),
        "a": torch.arange(7, dtype=torch.int64),
        "m": torch.zeros(0, 4, dtype=torch.float32),
        "s": torch.tensor(2.5),
    }
    path = tmp_path / "lib.safetensors"
    save_file(tensors, path, metadata={"k": "v"})
    h = read_header(path)
    assert h.metadata == {"k": "v"}
    assert h.file_size == path.stat().st_size
    for name, t in tensors.items():
        e = h.entries[name]
        assert (e.dtype, e.shape) == (st_dtype(t.dtype), tuple(t.shape))
        assert e.nbytes == t.numel() * t.element_size()
        assert torch.equal(MappedFile(path).view(e), t)
    assert [e.start for e in h.entries.values()] == sorted(e.start for e in h.entries.values())


# ----------------------------------------------------------------------------------------------
# corrupt headers


def _file(tmp_path: Path, header: bytes | dict, data: bytes = b"", n: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body) if n is None else n) + body + data)
    return path


def _entry(dtype: str, shape: list, begin: object, end: object) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("size", [0, 1, 7])
def test_read_header_rejects_files_under_8_bytes(tmp_path: Path, size: int) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x08" * size)
    with pytest.raises(HetquantError, match=rf"short\.safetensors: only {size} bytes"):
        read_header(path)


@pytest.mark.parametrize("n", [9, 1000, 2**63, 100 * 1024 * 1024 + 1])
def test_read_header_rejects_header_length_past_eof(tmp_path: Path, n: int) -> None:
    path = _file(tmp_path, b"{}      ", n=n)  # 16 bytes in all
    with pytest.raises(HetquantError, match=r"bad\.safetensors: header length") as e:
        read_header(path)
    shown = str(e.value).replace(str(path), "<path>")  # the path may hold any digits
    assert str(n) not in shown  # the file's first 8 bytes are never shown (issue 25 §1)


def test_read_header_shows_no_bytes_of_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "secret.safetensors"
    for secret in (b"\x10\x00\x00\x00\x00\x00\x00\x00\xffSECRET-TOKEN!!!", b"password=hunter2\n"):
        path.write_bytes(secret)
        with pytest.raises(HetquantError) as e:
            read_header(path)
        shown = str(e.value)
        assert not any(w in shown for w in ("password", "hunter2", "SECRET", "0xff", "\\xff"))
    assert str(int.from_bytes(b"password", "little")) not in shown  # the first 8 bytes as a length


@pytest.mark.parametrize(
    "body",
    [b"{not json}", b'{"a": {"dtype": "F32"', b"\xff\xfe{}", b"        "],
    ids=["syntax", "cut", "not-utf8", "blank"],
)
def test_read_header_rejects_invalid_json(tmp_path: Path, body: bytes) -> None:
    with pytest.raises(HetquantError, match=r"bad\.safetensors: header: invalid JSON"):
        read_header(_file(tmp_path, body))


@pytest.mark.parametrize("body", [b"[]", b"3", b'"x"'])
def test_read_header_rejects_non_object_headers(tmp_path: Path, body: bytes) -> None:
    with pytest.raises(HetquantError, match=r"bad\.safetensors: header is not a JSON object"):
        read_header(_file(tmp_path, body))


@pytest.mark.parametrize(
    "entries",
    [
        {"t": _entry("F32", [2], 0, 8)},  # 8 data bytes, file has 4
        {"u": _entry("U8", [4], 0, 4), "t": _entry("F32", [1], 4, 8)},
        {"t": _entry("U8", [1], 100, 101)},
    ],
)
def test_read_header_rejects_offsets_past_the_end(tmp_path: Path, entries: dict) -> None:
    with pytest.raises(HetquantError, match=r"bad\.safetensors: tensor 't' ends at byte .* past"):
        read_header(_file(tmp_path, entries, b"\0" * 4))


@pytest.mark.parametrize(
    "entry",
    [
        _entry("F32", [2], 0, 4),  # too short for its dtype x shape
        _entry("F32", [2], 0, 12),  # too long
        _entry("BF16", [2, 2], 0, 4),
        _entry("U8", [4], 4, 0),  # begin > end
        _entry("U8", [2], -2, 0),
    ],
)
def test_read_header_rejects_offsets_disagreeing_with_dtype_and_shape(
    tmp_path: Path, entry: dict
) -> None:
    with pytest.raises(HetquantError, match=r"bad\.safetensors: tensor 't' has data_offsets"):
        read_header(_file(tmp_path, {"t": entry}, b"\0" * 16))


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [1]},  # no data_offsets
        {"shape": [1], "data_offsets": [0, 4]},  # no dtype
        {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]},
        {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]},
        {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]},
        {"dtype": "F32", "shape": [1], "data_offsets": None},
        {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]},
        {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]},
        ["F32", [1], [0, 4]],
        None,
    ],
)
def test_read_header_rejects_malformed_entries_naming_file_and_tensor(
    tmp_path: Path, entry: object
) -> None:
    with pytest.raises(HetquantError, match=r"bad\.safetensors: .*tensor 't'"):
        read_header(_file(tmp_path, {"t": entry}, b"\0" * 16))


@pytest.mark.parametrize("metadata", [5, "x", [1, 2], {"a": 1}])
def test_read_header_rejects_malformed_metadata(tmp_path: Path, metadata: object) -> None:
    with pytest.raises(HetquantError, match=r"bad\.safetensors: .*__metadata__"):
        read_header(_file(tmp_path, {"__metadata__": metadata}))


# issue 25 §2: the safetensors spec (and its library's ``Metadata::validate``) wants the entries,
# sorted by offset, to tile the data area: an overlap read ``lm_head`` as the embedding's bytes.
@pytest.mark.parametrize(
    ("entries", "data", "match"),
    [
        (  # two tensors on the same bytes
            {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [4], 0, 4)},
            b"\0" * 4,
            r"tensor '[ab]' .* overlaps tensor '[ab]'",
        ),
        (  # half overlapping
            {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [4], 2, 6)},
            b"\0" * 6,
            r"tensor 'b' .* overlaps tensor 'a'",
        ),
        (  # a gap before the first tensor
            {"a": _entry("U8", [4], 4, 8)},
            b"\0" * 8,
            r"tensor 'a' .* leaves 4 bytes unowned",
        ),
        (  # a gap between two tensors
            {"a": _entry("U8", [2], 0, 2), "b": _entry("U8", [2], 4, 6)},
            b"\0" * 6,
            r"tensor 'b' .* leaves 2 bytes unowned after tensor 'a'",
        ),
        (  # bytes after the last tensor
            {"a": _entry("U8", [2], 0, 2)},
            b"\0" * 5,
            r"tensors end at byte .* 3 bytes no tensor owns",
        ),
    ],
    ids=["same-bytes", "overlap", "leading-gap", "gap", "tail"],
)
def test_read_header_rejects_entries_that_do_not_tile_the_data(
    tmp_path: Path, entries: dict, data: bytes, match: str
) -> None:
    with pytest.raises(HetquantError, match=rf"bad\.safetensors: .*{match}"):
        read_header(_file(tmp_path, entries, data))


def test_read_header_accepts_empty_tensors_between_others(tmp_path: Path) -> None:
    entries = {
        "a": _entry("U8", [2], 0, 2),
        "e": _entry("F32", [0, 3], 2, 2),
        "b": _entry("U8", [2], 2, 4),
    }
    h = read_header(_file(tmp_path, entries, b"\0" * 4))
    assert list(h.entries) == ["a", "e", "b"] and h.entries["e"].nbytes == 0


def test_read_header_refuses_deeply_nested_json(tmp_path: Path) -> None:
    body = b'{"__metadata__": {"x": "y"}, "t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(HetquantError, match=r"bad\.safetensors: header: JSON nested more than"):
        read_header(_file(tmp_path, body))
