"""Write the layout of a real vision-language MoE checkpoint, with no data: Qwen3-VL-235B-A22B and
Qwen3-VL-30B-A3B (BF16 with fused experts, or their -FP8 repos' per-expert block FP8), Kimi K2.5
(INT4 compressed-tensors experts).

Every tensor name, dtype and shape (from the config beside this file, through hetquant's role
tables), split into ~4 GB shards; the data is a sparse hole, so anything that reads headers only
(``hetquant convert --dry-run``, ``inspect``) runs on it as on the real checkpoint.

- ``bf16`` (Qwen3-VL): every tensor BF16, each MoE layer's routed experts fused as released,
  ``mlp.experts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``.
- ``fp8`` (Qwen3-VL): the text decoder's linears but the router as 128×128 block FP8 + F32
  ``weight_scale_inv``, experts per expert; the vision tower BF16 (its place in the -FP8 repos'
  ``modules_to_not_convert`` is not verified here; it is kept at source precision either way).
- ``int4`` (K2.5): the routed experts compressed-tensors pack-quantized, group 32, as
  ``quantization_config`` says (``examples/deepseek-v3-layout/make_layout.py``'s rule); the rest
  BF16, vision included.

Configs: the Qwen3-VL text dims as Qwen's configs are remembered (the 235B / 30B text decoders of
Qwen3-235B-A22B / 30B-A3B, mrope sections [24, 20, 20], theta 5e6), the vision config
transformers' defaults for Qwen/Qwen3-VL-30B-A3B-Instruct (``configuration_qwen3_vl_moe.py:
130-142``) with ``out_hidden_size`` the text hidden size; K2.5's text config is K2 Thinking's
(``examples/deepseek-v3-layout/config_kimi_k2_thinking.json``), its vision config in the remote
code's schema with transformers' defaults (``configuration_kimi_k25.py:42-53``). Not re-read from
the Hub: UNVERIFIED beyond those sources.

    python examples/vlm-layout/make_layout.py OUT_DIR --model Qwen3-VL-235B-A22B [--dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
from pathlib import Path
from types import SimpleNamespace

from hetquant.formats import TensorMeta
from hetquant.formats.families import SCALE_SUFFIX, ModelConfig, expected_tensors
from hetquant.formats.fp8_block import scale_shape
from hetquant.formats.safetensors_io import build_header, create_file

HERE = Path(__file__).resolve().parent
MODELS = {"Qwen3-VL-235B-A22B": ("bf16", "fp8"), "Qwen3-VL-30B-A3B": ("bf16", "fp8"),
          "Kimi-K2.5": ("int4",)}  # fmt: skip
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}  # fmt: skip
SHARD_BYTES = 4 * 10**9
DS = SimpleNamespace(**runpy.run_path(str(HERE.parent / "deepseek-v3-layout" / "make_layout.py")))


def source_tensors(cfg: ModelConfig, dtype: str) -> list[tuple[str, TensorMeta]]:
    """(name, meta) of every stored tensor in model order (module docstring)."""
    if dtype == "int4":
        return [(n, m) for n, m, _ in DS.source_tensors(cfg)]
    out: list[tuple[str, TensorMeta]] = []
    fused: set[int] = set()
    for name, tr in expected_tensors(cfg).items():
        role = tr.role
        if role.expert == "routed" and dtype == "bf16":
            if tr.layer not in fused:  # the layer's two fused tensors, once
                fused.add(tr.layer)
                e, (i, h) = cfg.num_experts, tr.shape if role.mlp != "down" else tr.shape[::-1]
                out.append((f"{tr.stack}.gate_up_proj", TensorMeta("BF16", (e, h, 2 * i))))
                out.append((f"{tr.stack}.down_proj", TensorMeta("BF16", (e, i, h))))
            continue
        text_linear = role.kind == "linear" and role.scope != "vision"
        if dtype == "fp8" and text_linear:
            out.append((name, TensorMeta("F8_E4M3", tr.shape)))
            out.append((name + SCALE_SUFFIX, TensorMeta("F32", scale_shape(tr.shape, 128))))  # type: ignore[arg-type]
        else:
            out.append((name, TensorMeta("BF16", tr.shape)))
    return out


def write_layout(out: Path, model: str, dtype: str) -> Path:
    """Write the layout of ``model`` (``dtype``: one of ``MODELS[model]``) into ``out``."""
    raw = json.loads((HERE / f"{model}.config.json").read_text())
    if dtype == "fp8":
        raw["quantization_config"] = FP8_CONFIG
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = source_tensors(ModelConfig.from_dict(raw), dtype)
    total = sum(m.nbytes for _, m in tensors)
    n = math.ceil(total / SHARD_BYTES)
    shards: list[list[tuple[str, TensorMeta]]] = [[] for _ in range(n)]
    done = 0
    for name, meta in tensors:
        shards[min(n - 1, done * n // total)].append((name, meta))
        done += meta.nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        create_file(
            out / fname, build_header(shard, {"format": "pt"}), sum(m.nbytes for _, m in shard)
        )
        weight_map |= {k: fname for k, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=list(MODELS), default="Qwen3-VL-235B-A22B")
    ap.add_argument("--dtype", choices=("bf16", "fp8", "int4"), default=None)
    args = ap.parse_args()
    write_layout(args.out, args.model, args.dtype or MODELS[args.model][0])


if __name__ == "__main__":
    main()
