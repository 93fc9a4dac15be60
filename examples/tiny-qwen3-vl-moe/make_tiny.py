"""Write a tiny random Qwen3-VL-MoE checkpoint, laid out as the Qwen3-VL-*-A*B (BF16) or -FP8 repos.

The model is transformers' own ``Qwen3VLMoeForConditionalGeneration`` (vision tower, mergers and
deepstack mergers included) built from a tiny ``Qwen3VLMoeConfig``; its parameters are redrawn
from one seeded generator per tensor (``tiny-tools/draw.py``: the same bytes on every CPU; norms
≈ 1, biases small, weights ~ N(0, 1/in); transformers' own init leaves the routers at zero, which
ties every expert), then written:

* ``--dtype bf16`` (default): every tensor BF16, each MoE layer's experts fused as the released
  checkpoints store them — ``mlp.experts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``,
  the transpose of the module's parameters (transformers transposes them back at load,
  ``conversion_mapping.py:1450-1461``). ``save_pretrained`` would write the module layout
  instead, so the state dict is written here.
* ``--dtype fp8``: experts per expert (``mlp.experts.N.{gate,up,down}_proj.weight``) and every
  linear of the text decoder but the router, plus the vision blocks' ``attn.qkv`` / ``attn.proj``
  / ``mlp.linear_fc1`` / ``linear_fc2``, as 128×128 block FP8 (E4M3 ``weight`` + F32
  ``weight_scale_inv``); ``quantization_config.modules_to_not_convert`` names what stays BF16
  (the routers, embeddings, lm_head, the patch embedding and the mergers).

Dims: text hidden 256, 8 query / 2 KV heads of 32, 8 experts of 512 (``H != 2I`` and ``H != I``:
the fused orientation is unambiguous), layer 1 dense (``mlp_only_layers``); vision hidden 64,
2 blocks, patch 4, merge 2, one deepstack merger. Processor files (image and video preprocessor
configs, a chat template) and the tiny DeepSeek-V3 example's 640-token tokenizer travel along.

Usage::

    python examples/tiny-qwen3-vl-moe/make_tiny.py OUT [--dtype bf16|fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from hetquant.formats.fp8_block import Fp8Block

HERE = Path(__file__).resolve().parent
DRAW = SimpleNamespace(**runpy.run_path(str(HERE.parent / "tiny-tools" / "draw.py")))
TOKENIZER_DIR = HERE.parent / "tiny-deepseek-v3"
SEED = 20251015  # Qwen3-VL-30B-A3B's release month

TEXT = {
    "vocab_size": 640, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 512,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1], "decoder_sparse_step": 1,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                        "mrope_section": [8, 4, 4], "mrope_interleaved": True},
}  # fmt: skip
VISION = {
    "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 4,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 256,
    "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
}  # fmt: skip
NOT_CONVERTED = ["lm_head", "model.language_model.embed_tokens", "mlp.gate",
                 "model.visual.patch_embed", "model.visual.pos_embed", "model.visual.merger",
                 "model.visual.deepstack_merger_list"]  # fmt: skip
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128], "modules_to_not_convert": NOT_CONVERTED}  # fmt: skip
PROCESSOR = {"do_resize": True, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "size": {"shortest_edge": 256, "longest_edge": 4096}}  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_model() -> torch.nn.Module:
    """transformers' Qwen3VLMoeForConditionalGeneration of the tiny config, float32."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    cfg = Qwen3VLMoeConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    model = Qwen3VLMoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.state_dict().items())):
            x = DRAW.normal(SEED + i, p.shape)
            if name.endswith("bias"):
                x = 0.02 * x
            elif p.ndim == 1:
                x = 1 + 0.1 * x
            else:
                x = x / math.sqrt(p[0].numel() if "experts" not in name else p.shape[-1])
            p.copy_(x.to(torch.bfloat16).float())  # BF16-representable: the source is BF16
    return model


def _fused_linears(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Module experts [E, 2I, H] / [E, H, I] → per-expert linears ``{e}.{gate,up,down}_proj``."""
    prefix, leaf = name.rsplit(".", 1)
    if leaf == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    gate, up = t.chunk(2, dim=1)
    out = {f"{prefix}.{e}.gate_proj.weight": gate[e] for e in range(t.shape[0])}
    return out | {f"{prefix}.{e}.up_proj.weight": up[e] for e in range(t.shape[0])}


def build_tensors(model: torch.nn.Module, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the released repos name and store them (module docstring)."""
    fp8, out = Fp8Block(), {}
    for name, t in model.state_dict().items():
        t = t.to(torch.bfloat16)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            if dtype == "bf16":  # the released layout: the module's transpose
                out[name] = t.transpose(1, 2).contiguous()
                continue
            parts = _fused_linears(name, t)
        else:
            parts = {name: t}
        for n, w in parts.items():
            quantized = (
                dtype == "fp8"
                and w.ndim == 2
                and n.endswith(".weight")
                and not any(
                    m in n for m in ("mlp.gate.", "embed", "lm_head", "merger", "pos_embed")
                )
            )
            if quantized:
                q = fp8.quantize(w.float().contiguous())
                out |= {n: q["weight"], f"{n}_scale_inv": q["weight_scale_inv"]}
            else:
                out[n] = w.contiguous()
    return out


def write_checkpoint(out: Path, dtype: str = "bf16") -> Path:
    """Write the checkpoint into ``out`` (created): two shards, index, config, processor files."""
    model = build_model()
    tensors = build_tensors(model, dtype)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    half = {n for n in names if n.startswith(("model.language_model.layers.2", "model.visual"))}
    weight_map = {}
    for i, members in enumerate((sorted(set(names) - half), sorted(half)), start=1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in members}, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(members, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _json(out / "model.safetensors.index.json",
          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})  # fmt: skip
    config = model.config.to_dict()
    config |= {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "dtype": "bfloat16"}
    if dtype == "fp8":
        config["quantization_config"] = FP8_CONFIG
    _json(out / "config.json", config)
    _json(
        out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    )
    _json(out / "preprocessor_config.json",
          {**PROCESSOR, "image_processor_type": "Qwen2VLImageProcessorFast",
           "processor_class": "Qwen3VLProcessor"})  # fmt: skip
    _json(out / "video_preprocessor_config.json",
          {**PROCESSOR, "video_processor_type": "Qwen3VLVideoProcessor"})  # fmt: skip
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / f, out / f)
    return out


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = ap.parse_args()
    write_checkpoint(args.out, args.dtype)


if __name__ == "__main__":
    main()
