"""The embedded tiny DeepSeek-V3 checkpoint: reproducible, laid out as DeepSeek ships V3 / R1."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-deepseek-v3"
TOOLS = TINY.parent / "tiny-tools"  # the generator and training scripts, the texts
NOT_GENERATED = {"README.md"}  # the model card
FP8_LINEAR = re.compile(
    r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)
MTP_EXTRAS = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _header(path: Path) -> dict[str, dict]:
    """safetensors header of ``path``: tensor name → {dtype, shape, data_offsets}."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


@pytest.fixture(scope="module")
def index() -> dict:
    return json.loads((TINY / "model.safetensors.index.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((TINY / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def headers(index: dict) -> dict[str, dict[str, dict]]:
    """shard file name → its header."""
    return {f: _header(TINY / f) for f in sorted(set(index["weight_map"].values()))}


@pytest.fixture(scope="module")
def tensors(headers: dict) -> dict[str, dict]:
    """tensor name → header entry, with the shard it lives in under ``"file"``."""
    return {name: {**meta, "file": f} for f, h in headers.items() for name, meta in h.items()}


def test_regeneration_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    cmd = [sys.executable, str(TOOLS / "make_tiny.py"), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    committed = {p.name for p in TINY.iterdir() if p.is_file()} - NOT_GENERATED
    assert {p.name for p in out.iterdir()} == committed
    for name in sorted(committed):
        assert _sha256(out / name) == _sha256(TINY / name), f"{name} differs when regenerated"


def test_every_fp8_weight_has_a_block_scale(tensors: dict, index: dict) -> None:
    fp8 = {n: m for n, m in tensors.items() if m["dtype"] == "F8_E4M3"}
    scales = {n for n in tensors if n.endswith("_scale_inv")}
    assert fp8 and scales == {f"{n}_scale_inv" for n in fp8}
    for name, meta in fp8.items():
        out, inp = meta["shape"]
        scale = tensors[f"{name}_scale_inv"]
        assert scale["dtype"] == "F32"
        assert scale["shape"] == [-(-out // 128), -(-inp // 128)], name
    assert index["weight_map"]  # the index lists the scales too (checked in the coverage test)


def test_some_scale_lives_in_another_shard(tensors: dict) -> None:
    apart = [
        n
        for n in tensors
        if n.endswith("_scale_inv")
        and tensors[n]["file"] != tensors[n[: -len("_scale_inv")]]["file"]
    ]
    assert apart, "no weight_scale_inv is stored apart from its weight"


def test_index_covers_exactly_the_shards(index: dict, headers: dict, tensors: dict) -> None:
    assert sum(len(h) for h in headers.values()) == len(tensors)  # no name in two shards
    assert index["weight_map"] == {n: m["file"] for n, m in tensors.items()}
    n = len(headers)
    assert sorted(headers) == [f"model-{i:05d}-of-{n:06d}.safetensors" for i in range(1, n + 1)]


def test_total_size(index: dict, tensors: dict) -> None:
    nbytes = sum(m["data_offsets"][1] - m["data_offsets"][0] for m in tensors.values())
    assert index["metadata"] == {"total_size": nbytes}


def test_dtypes_and_mtp_layout(tensors: dict, headers: dict, config: dict) -> None:
    for name, meta in tensors.items():
        if name.endswith("_scale_inv") or name.endswith("e_score_correction_bias"):
            want = "F32"
        elif FP8_LINEAR.search(name):
            want = "F8_E4M3"
        else:
            want = "BF16"
        assert meta["dtype"] == want, name
    h, vocab, mtp = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    extras = {
        n for n in tensors if n.startswith(f"model.layers.{mtp}.") and n.split(".")[3] in MTP_EXTRAS
    }
    assert {n: tensors[n]["shape"] for n in extras} == {
        f"model.layers.{mtp}.enorm.weight": [h],
        f"model.layers.{mtp}.hnorm.weight": [h],
        f"model.layers.{mtp}.eh_proj.weight": [h, 2 * h],
        f"model.layers.{mtp}.embed_tokens.weight": [vocab, h],
        f"model.layers.{mtp}.shared_head.norm.weight": [h],
        f"model.layers.{mtp}.shared_head.head.weight": [vocab, h],
    }
    assert {tensors[n]["file"] for n in extras} == {max(headers)}
    kv_a = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["shape"]
    assert kv_a == [config["kv_lora_rank"] + config["qk_rope_head_dim"], h]  # 160: partial block
    e = config["n_routed_experts"]
    assert tensors[f"model.layers.{mtp}.mlp.gate.weight"]["shape"] == [e, h]
    assert f"model.layers.{mtp}.mlp.experts.{e - 1}.down_proj.weight" in tensors
    dense = config["first_k_dense_replace"]
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    assert f"model.layers.{dense}.mlp.gate.e_score_correction_bias" in tensors


def test_tokenizer_round_trips_english(config: dict) -> None:
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == config["bos_token_id"] == 0
    assert tok.token_to_id("<｜end▁of▁sentence｜>") == config["eos_token_id"] == 1
    text = "The quick brown fox jumps over the lazy dog, 12345 times."
    enc = tok.encode(text)
    assert enc.ids[0] == 0  # add_bos_token
    assert tok.decode(enc.ids) == text


def test_tokenizer_training_is_deterministic() -> None:
    """Retraining gives the same bytes (the committed file is reused because the training text,
    ``pydoc_data.topics``, changes between Python versions)."""
    spec = importlib.util.spec_from_file_location("make_tiny", TOOLS / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    first = make_tiny.train_tokenizer(make_tiny.VOCAB_SIZE)
    assert make_tiny.train_tokenizer(make_tiny.VOCAB_SIZE) == first
    assert Tokenizer.from_str(first).get_vocab_size(with_added_tokens=True) == make_tiny.VOCAB_SIZE
