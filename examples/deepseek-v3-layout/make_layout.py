"""Write the layout of the real DeepSeek-V3/R1 FP8 checkpoint, with no data.

Every real tensor name, dtype and shape (from ``config.json`` beside this file — the published
DeepSeek-V3 config — through hetquant's role table), split over 163 shards named as DeepSeek names
them (``model-%05d-of-000163.safetensors``), the MTP layer's extra tensors in the last shard, and
``model.safetensors.index.json``. Each shard holds a real header; its data is a sparse hole
(``truncate``), so the ~690 GB layout costs a few MB of disk. Anything that reads only headers —
``hetquant convert --dry-run``, ``inspect``, the loader's planning — runs on it as on the real thing.

Other models of the family's configs beside this file (``--config``; the published configs' keys
and values, ``reference/model_families.md``): ``config_kimi_k2.json`` (Kimi-K2-Instruct, block
FP8, 62 shards, no MTP), ``config_kimi_k2_thinking.json`` (Kimi-K2-Thinking: the linears its
compressed-tensors ``quantization_config`` covers — the routed experts — pack-quantized INT4,
everything else BF16) and ``config_deepseek_v32.json`` (DeepSeek-V3.2, with its indexer; its
``weights_proj`` is BF16). Without MTP extras every shard takes main-model tensors.

    python examples/deepseek-v3-layout/make_layout.py OUT_DIR [--config other_config.json] [--shards N]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hetquant.formats import TensorMeta, get_format
from hetquant.formats.ct_scheme import CT_METHOD, CtQuantConfig
from hetquant.formats.families import SCALE_SUFFIX, ModelConfig, expected_tensors
from hetquant.formats.fp8_block import scale_shape
from hetquant.formats.safetensors_io import build_header, create_file

HERE = Path(__file__).resolve().parent
N_SHARDS = 163
SHARD_NAME = "model-{:05d}-of-{:06d}.safetensors"
# Which roles DeepSeek ships as what (README_WEIGHTS.md; reference/ascend_formats.md §1.3).
BF16_LINEARS = {"mtp_eh_proj", "indexer_weights_proj"}
F32_ROLES = {"router_bias"}


def source_tensors(cfg: ModelConfig) -> list[tuple[str, TensorMeta, bool]]:
    """(name, meta, is MTP extra) of every stored tensor in model order, scales after weights."""
    block = (cfg.weight_block_size or (128, 128))[0]
    qc = cfg.raw.get("quantization_config") or {}
    ct = CtQuantConfig.parse(qc) if qc.get("quant_method") == CT_METHOD else None
    out = []
    for name, tr in expected_tensors(cfg).items():
        role = tr.role
        extra = role.scope == "mtp"
        if ct is not None:  # compressed-tensors: what its schemes cover, the rest BF16
            quantized = _ct_tensors(ct, name, role.kind, tr.shape)
            out.extend((n, m, extra) for n, m in quantized)
            if quantized:
                continue
        if ct is None and role.kind == "linear" and role.name not in BF16_LINEARS:
            out.append((name, TensorMeta("F8_E4M3", tr.shape), extra))
            out.append(
                (name + SCALE_SUFFIX, TensorMeta("F32", scale_shape(tr.shape, block)), extra)
            )  # type: ignore[arg-type]
        else:
            out.append(
                (name, TensorMeta("F32" if role.name in F32_ROLES else "BF16", tr.shape), extra)
            )
    return out


def _ct_tensors(
    ct: CtQuantConfig, name: str, kind: str, shape: tuple[int, ...]
) -> list[tuple[str, TensorMeta]]:
    prefix = name.removesuffix(".weight")
    scheme = ct.scheme_for(prefix, kind, stored_quantized=False) if len(shape) == 2 else None
    if scheme is None:
        return []
    fmt = get_format("ct_pack_quantized", group_size=scheme.group_size, shape_dtype="I32")
    return [(f"{prefix}.{k}", m) for k, m in fmt.stored(shape).items()]


def split_shards(
    tensors: list[tuple[str, TensorMeta, bool]], n: int
) -> list[list[tuple[str, TensorMeta]]]:
    """Main tensors over the first n-1 shards by size; the MTP extras alone in the last."""
    main = [(k, m) for k, m, extra in tensors if not extra]
    extras = [(k, m) for k, m, extra in tensors if extra]
    n_main = n - 1 if extras else n
    total = sum(m.nbytes for _, m in main)
    shards: list[list[tuple[str, TensorMeta]]] = [[] for _ in range(n)]
    done = 0
    for k, m in main:
        shards[min(n_main - 1, done * n_main // total)].append((k, m))
        done += m.nbytes
    if extras:
        shards[-1] = extras
    return shards


def write_layout(out: Path, config: Path = HERE / "config.json", n_shards: int = N_SHARDS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, out / "config.json")
    cfg = ModelConfig.load(out / "config.json")
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(split_shards(source_tensors(cfg), n_shards)):
        name = SHARD_NAME.format(i + 1, n_shards)
        data = sum(m.nbytes for _, m in tensors)
        create_file(out / name, build_header(tensors, {"format": "pt"}), data)
        weight_map.update({k: name for k, _ in tensors})
        total += data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", type=Path, default=HERE / "config.json")
    ap.add_argument("--shards", type=int, default=N_SHARDS)
    args = ap.parse_args()
    write_layout(args.out, args.config, args.shards)


if __name__ == "__main__":
    main()
