"""A synthetic DeepSeek-V3 FP8 checkpoint at REAL tensor shapes, cut down to two layers.

``config.json`` is the real DeepSeek-V3 one (every key, in its order) except:

====================================  ===========  =========================================
key                                   real         here
====================================  ===========  =========================================
``num_hidden_layers``                 61           2 (layer 0 dense, layer 1 MoE)
``first_k_dense_replace``             3            1
``n_routed_experts``                  256          16 (``--experts``)
``num_nextn_predict_layers``          1            0 (no MTP layer)
``vocab_size``                        129280       1024 (``--vocab``)
====================================  ===========  =========================================

Everything else is real: hidden 7168, MLA (q_lora 1536, kv_lora 512, 128 heads, nope/rope/v
128/64/128), dense intermediate 18432, MoE intermediate 2048, one shared expert, 128×128 FP8
blocks, and the routing keys ``n_group`` 8 / ``topk_group`` 4 / ``num_experts_per_tok`` 8, which
stay consistent as long as the expert count is a multiple of 8 and at least 16 (8 groups of ≥ 2
experts, 4 groups × ≥ 2 ≥ 8 picks). The vocabulary is small so that the two BF16 [vocab, 7168]
matrices (embeddings, lm_head: 1.8 GB each at the real vocab) do not dominate a benchmark of FP8
conversion; at 1024 they are 14.7 MB each.

The checkpoint is ONE shard, ``model-00001-of-000001.safetensors`` (DeepSeek's six-digit total),
plus ``model.safetensors.index.json`` mapping every tensor (scales included) — about 1.5 GB with 16
experts: attention 187 MB per layer, the dense MLP 396 MB, each expert 44 MB. Names, dtypes and
shapes are DeepSeek's: FP8 E4M3 linear weights with an F32 ``weight_scale_inv``
[ceil(out/128), ceil(in/128)], BF16 norms, embeddings, lm_head and router ``gate.weight``, F32
``gate.e_score_correction_bias``. Tensors are laid out in the file as ``safetensors.save_file``
lays them out (by dtype, widest first, then by name).

Data are random, deterministic by ``--seed`` and tensor name (each tensor has its own PCG64
stream, so one tensor's bytes do not depend on the others), and fast to make: FP8 codes are raw
random bytes with the lowest mantissa bit cleared, which rules out the NaN codes 0x7F / 0xFF (and
uses half the codes: every even one, ±448 included); scales are log-uniform in [2^-16, 2^-10]
(what ``amax / 448`` gives for weights of magnitude 0.007 to 0.4). Nothing goes through
``fp8_block.quantize``. BF16 and F32 tensors are Gaussian (norms around 1). Generation streams
8 MB at a time, so it needs little memory.

``SYNTHETIC.json`` (the generation parameters) is written last; the benchmark regenerates the
directory when that file is absent or says otherwise.

Usage::

    python benchmarks/make_synthetic.py DIR [--experts 16] [--vocab 1024] [--seed 0]
        [--dense-layers 1|0] [--jobs N] [--moe-layers N]

``--dense-layers 0`` leaves layer 0 out (one MoE layer: 0.97 GB with 16 experts, the "1 GB
real-shape shard" of issue #16's two-core target); ``--jobs N`` generates tensors in N processes
(the bytes do not change); ``--moe-layers N`` writes N MoE layers after the dense one (more than
two layers in all: one shard per layer, as DeepSeek's own checkpoint is cut; the source of
``bench_convert_limit.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHARD = "model-00001-of-000001.safetensors"
INDEX = "model.safetensors.index.json"
MARKER = "SYNTHETIC.json"
BLOCK = 128
CHUNK = 8 << 20  # bytes generated and written at a time
SCALE_LOG2 = (-16.0, -10.0)

# The real DeepSeek-V3 HF config.json (every key, in its order); see OVERRIDES below.
REAL_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def make_config(experts: int = 16, vocab: int = 1024) -> dict:
    """The real config with the documented overrides; refuses expert counts routing can't use."""
    c = REAL_CONFIG
    per_group, rem = divmod(experts, c["n_group"])
    if rem or per_group * c["topk_group"] < c["num_experts_per_tok"]:
        raise SystemExit(
            f"error: --experts {experts}: must be a multiple of n_group={c['n_group']} with "
            f"topk_group={c['topk_group']} groups holding >= num_experts_per_tok="
            f"{c['num_experts_per_tok']} experts, i.e. a multiple of 8, at least 16"
        )
    if vocab <= 0:
        raise SystemExit(f"error: --vocab {vocab}: must be positive")
    return {
        **c,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "n_routed_experts": experts,
        "num_nextn_predict_layers": 0,
        "vocab_size": vocab,
    }


# ------------------------------------------------------------------------------------------------
# tensor list


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str  # F8_E4M3 | F32 | BF16
    shape: tuple[int, ...]
    kind: str  # fp8 | scale | norm | dense  (how to fill it)
    std: float = 1.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[self.dtype]


def _linear(prefix: str, out: int, inp: int) -> list[Spec]:
    sshape = (-(-out // BLOCK), -(-inp // BLOCK))
    return [
        Spec(f"{prefix}.weight", "F8_E4M3", (out, inp), "fp8"),
        Spec(f"{prefix}.weight_scale_inv", "F32", sshape, "scale"),
    ]


def _norm(name: str, size: int) -> list[Spec]:
    return [Spec(name, "BF16", (size,), "norm", 0.05)]


def _mlp(prefix: str, hidden: int, inter: int) -> list[Spec]:
    return [
        *_linear(f"{prefix}.gate_proj", inter, hidden),
        *_linear(f"{prefix}.up_proj", inter, hidden),
        *_linear(f"{prefix}.down_proj", hidden, inter),
    ]


def tensor_specs(c: dict) -> list[Spec]:
    """Every tensor of a DeepSeek-V3 checkpoint for config ``c`` (no MTP layer), model order."""
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
    if c["num_nextn_predict_layers"]:
        raise ValueError("make_synthetic writes no MTP layer; set num_nextn_predict_layers 0")
    specs = [Spec("model.embed_tokens.weight", "BF16", (vocab, h), "dense", 1.0)]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        specs += _norm(f"{p}.input_layernorm.weight", h)
        specs += _linear(f"{a}.q_a_proj", q_rank, h)
        specs += _norm(f"{a}.q_a_layernorm.weight", q_rank)
        specs += _linear(f"{a}.q_b_proj", heads * (nope + rope), q_rank)
        specs += _linear(f"{a}.kv_a_proj_with_mqa", kv_rank + rope, h)
        specs += _norm(f"{a}.kv_a_layernorm.weight", kv_rank)
        specs += _linear(f"{a}.kv_b_proj", heads * (nope + v), kv_rank)
        specs += _linear(f"{a}.o_proj", h, heads * v)
        specs += _norm(f"{p}.post_attention_layernorm.weight", h)
        m = f"{p}.mlp"
        if layer < c["first_k_dense_replace"]:
            specs += _mlp(m, h, c["intermediate_size"])
            continue
        n_exp, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        specs.append(Spec(f"{m}.gate.weight", "BF16", (n_exp, h), "dense", 1 / math.sqrt(h)))
        specs.append(Spec(f"{m}.gate.e_score_correction_bias", "F32", (n_exp,), "dense", 0.01))
        for e in range(n_exp):
            specs += _mlp(f"{m}.experts.{e}", h, inter)
        specs += _mlp(f"{m}.shared_experts", h, inter * c["n_shared_experts"])
    specs += _norm("model.norm.weight", h)
    specs.append(Spec("lm_head.weight", "BF16", (vocab, h), "dense", 1 / math.sqrt(h)))
    return specs


# ------------------------------------------------------------------------------------------------
# data


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def _fp8_chunks(rng: np.random.Generator, nbytes: int) -> Iterator[bytes]:
    """Random E4M3 codes with mantissa bit 0 cleared: never 0x7F / 0xFF (NaN)."""
    mask = np.uint64(0xFEFE_FEFE_FEFE_FEFE)
    left = nbytes
    while left:
        n = min(left, CHUNK)
        words = rng.bit_generator.random_raw(-(-n // 8))
        words &= mask
        yield words.view(np.uint8)[:n].tobytes()
        left -= n


def _float_bytes(spec: Spec, rng: np.random.Generator) -> bytes:
    n = math.prod(spec.shape)
    if spec.kind == "scale":
        lo, hi = SCALE_LOG2
        return np.exp2(rng.uniform(lo, hi, n)).astype("<f4").tobytes()
    x = rng.standard_normal(n, dtype=np.float32) * np.float32(spec.std)
    if spec.kind == "norm":
        x += np.float32(1.0)
    if spec.dtype == "F32":
        return x.astype("<f4").tobytes()
    return _to_bf16(x).tobytes()


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), round to nearest even (inputs are finite)."""
    bits = x.astype("<f4").view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


def _tensor_chunks(spec: Spec, seed: int) -> Iterator[bytes]:
    rng = _rng(seed, spec.name)
    if spec.kind == "fp8":
        yield from _fp8_chunks(rng, spec.nbytes)
    else:
        yield _float_bytes(spec, rng)


# ------------------------------------------------------------------------------------------------
# writing

_DTYPE_RANK = {"F32": 0, "BF16": 1, "F8_E4M3": 2}  # safetensors.save_file: widest dtype first


def _header(specs: list[Spec]) -> bytes:
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        doc[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [off, off + s.nbytes],
        }
        off += s.nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(len(body) + 8) % 8)
    return struct.pack("<Q", len(body)) + body


def with_layers(config: dict, dense_layers: int, moe_layers: int) -> dict:
    """``config`` with ``dense_layers`` (0 or 1) dense layers, then ``moe_layers`` MoE layers."""
    return {
        **config,
        "num_hidden_layers": dense_layers + moe_layers,
        "first_k_dense_replace": dense_layers,
    }


def moe_only(config: dict) -> dict:
    """``config`` without its dense layer: one MoE layer (``--dense-layers 0``)."""
    return with_layers(config, 0, 1)


def shard_names(specs: list[Spec], layers: int) -> dict[str, list[Spec]]:
    """Shard file → its tensors: one shard (``SHARD``) for up to two layers, else one per layer
    as DeepSeek's own checkpoint is cut (``model-00001-of-000061.safetensors``), the embedding
    in the first, the final norm and lm_head in the last."""
    if layers <= 2:
        return {SHARD: specs}
    out: dict[str, list[Spec]] = {}
    for s in specs:
        parts = s.name.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else (0 if "embed" in s.name else layers - 1)  # fmt: skip
        out.setdefault(f"model-{layer + 1:05d}-of-{layers:06d}.safetensors", []).append(s)
    return dict(sorted(out.items()))


def _write_specs(path: Path, offsets: list[tuple[Spec, int]], seed: int) -> None:
    """Generate ``offsets``' tensors into the (pre-sized) file ``path`` at their offsets."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for spec, off in offsets:
            for chunk in _tensor_chunks(spec, seed):
                os.pwrite(fd, chunk, off)
                off += len(chunk)
    finally:
        os.close(fd)


def _write_data(path: Path, specs: list[Spec], start: int, seed: int, jobs: int) -> None:
    """Every tensor's bytes, by ``jobs`` processes at once (the bytes do not depend on it)."""
    offsets, off = [], start
    for s in specs:
        offsets.append((s, off))
        off += s.nbytes
    with open(path, "r+b") as f:
        f.truncate(off)
    if jobs <= 1:
        _write_specs(path, offsets, seed)
        return
    import multiprocessing as mp

    parts: list[list[tuple[Spec, int]]] = [[] for _ in range(jobs)]
    for i, item in enumerate(sorted(offsets, key=lambda x: -x[0].nbytes)):
        parts[i % jobs].append(item)
    with mp.get_context("fork").Pool(jobs) as pool:
        pool.starmap(_write_specs, [(path, part, seed) for part in parts])


def _write_shard(out: Path, name: str, specs: list[Spec], seed: int, jobs: int) -> None:
    tmp = out / f".{name}.tmp"
    header = _header(specs)
    with open(tmp, "wb") as f:
        f.write(header)
    _write_data(tmp, specs, len(header), seed, jobs)
    os.replace(tmp, out / name)


def write_checkpoint(
    out: Path, experts: int = 16, vocab: int = 1024, seed: int = 0, quiet: bool = False,
    dense_layers: int = 1, jobs: int = 1, moe_layers: int = 1,
) -> dict:  # fmt: skip
    """Write the checkpoint into ``out`` (replacing a previous one); returns its SYNTHETIC.json.

    ``dense_layers`` 0 leaves the dense layer out; ``moe_layers`` MoE layers follow it (more
    than two layers in all: one shard per layer, ``shard_names``); ``jobs`` processes generate
    tensors in parallel (same bytes)."""
    config = make_config(experts, vocab)
    if (dense_layers, moe_layers) != (1, 1):
        config = with_layers(config, dense_layers, moe_layers)
    specs = sorted(tensor_specs(config), key=lambda s: (_DTYPE_RANK[s.dtype], s.name))
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    t0 = time.perf_counter()
    shards = shard_names(specs, config["num_hidden_layers"])
    for old in out.glob("*.safetensors"):  # a previous checkpoint's shards of other names
        if old.name not in shards:
            old.unlink()
    for name, part in shards.items():
        _write_shard(out, name, part, seed, jobs)
    data = sum(s.nbytes for s in specs)
    where = {s.name: name for name, part in shards.items() for s in part}
    index = {
        "metadata": {"total_size": data},
        "weight_map": {s.name: where[s.name] for s in sorted(specs, key=lambda s: s.name)},
    }
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    marker = {
        "generator": "benchmarks/make_synthetic.py",
        "experts": experts,
        "vocab": vocab,
        "seed": seed,
        "dense_layers": dense_layers,
        "moe_layers": moe_layers,
        "shards": list(shards),
        "tensors": len(specs),
        "data_bytes": data,
        "shard_bytes": sum((out / name).stat().st_size for name in shards),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if not quiet:
        print(
            f"wrote {out}: {len(specs)} tensors, {marker['shard_bytes'] / 1e9:.3f} GB in "
            f"{len(shards)} shard(s) "
            f"({marker['seconds']} s)"
        )
    return marker


def is_current(
    out: Path, experts: int, vocab: int, seed: int, dense_layers: int = 1, moe_layers: int = 1
) -> bool:
    """True when ``out`` holds a complete checkpoint made with these parameters."""
    try:
        m = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    want = {"experts": experts, "vocab": vocab, "seed": seed}
    same = all(m.get(k) == v for k, v in want.items()) and m.get("dense_layers", 1) == dense_layers
    same = same and m.get("moe_layers", 1) == moe_layers
    return same and all((out / name).is_file() for name in m.get("shards", [SHARD]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="output directory (created; a previous one replaced)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts (multiple of 8, >= 16)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocab_size (small on purpose)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dense-layers", type=int, choices=(0, 1), default=1, help="0: one MoE layer only"
    )
    ap.add_argument("--jobs", type=int, default=1, help="processes generating tensors (same bytes)")
    ap.add_argument("--moe-layers", type=int, default=1, help="MoE layers after the dense one")
    ap.add_argument(
        "--check",
        action="store_true",
        help="also open the result with hetquant's source validator (role table, scales)",
    )
    args = ap.parse_args(argv)
    if args.dir.exists() and any(args.dir.iterdir()) and not (args.dir / INDEX).exists():
        if not any(args.dir.glob(".*.safetensors.tmp")):
            sys.exit(f"error: {args.dir} is not empty and holds no checkpoint; choose another DIR")
        shutil.rmtree(args.dir)
    write_checkpoint(
        args.dir,
        args.experts,
        args.vocab,
        args.seed,
        dense_layers=args.dense_layers,
        jobs=args.jobs,
        moe_layers=args.moe_layers,
    )
    if args.check:
        from hetquant.convert import SourceCheckpoint

        src = SourceCheckpoint.open(args.dir)
        print(f"hetquant: {len(src.tensors)} tensors, {src.total_bytes:,} bytes, roles OK")


if __name__ == "__main__":
    main()
