"""Write a tiny random Kimi K2.5 checkpoint, laid out as moonshotai/Kimi-K2.5 (INT4 experts).

The text decoder is the tiny Kimi K2 Thinking one (``examples/kimi-k2/make_tiny.py``: DeepSeek-V3
names and config, routed experts compressed-tensors pack-quantized INT4 group 32, the rest BF16),
its names moved under ``language_model.`` (``language_model.model.…``,
``language_model.lm_head``). The vision tower and projector are transformers' own
``Kimi_K25ForConditionalGeneration`` modules of a tiny vision config, written under the
checkpoint's original names (the sources of transformers' renames, ``conversion_mapping.py:
658-710``: ``encoder.blocks.N.{norm0, norm1, wqkv, wo, mlp.fc0, mlp.fc1}``,
``patch_embed.pos_emb.weight``, ``mm_projector.proj.{0, 2}``) with values redrawn from a seeded
generator per tensor (``tiny-tools/draw.py``: the same bytes on every CPU; BF16). config.json:
``model_type kimi_k25``, the vision config in the remote code's schema (``vt_*``,
``init_pos_emb_*``), the compressed-tensors ``quantization_config`` inside ``text_config`` (its
``ignore`` adds the vision tower and projector). The tokenizer is K2's with K2.5's media tokens in
its first reserved slots (``MEDIA``; ``media_placeholder_token_id`` is ``<|media_pad|>``'s), and
preprocessor_config.json holds K2.5's ``media_proc_cfg`` (the released values, as RTP-LLM's and
vLLM's defaults for K2.5 list them, with the tiny patch size): vLLM reads both to profile its
vision encoder (``kimi_k25_vision_fused.py``, ``KimiK25ProcessingInfo``).

    python examples/kimi-k25/make_tiny.py OUT
"""

from __future__ import annotations

import argparse
import json
import math
import re
import runpy
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
DRAW = SimpleNamespace(**runpy.run_path(str(HERE.parent / "tiny-tools" / "draw.py")))
K2 = SimpleNamespace(**runpy.run_path(str(HERE.parent / "kimi-k2" / "make_tiny.py")))
SEED = 20260127  # K2.5's release
VISION = {"patch_size": 4, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
          "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 64,
          "vt_intermediate_size": 128, "merge_kernel_size": [2, 2], "mm_hidden_size": 64,
          "projector_ln_eps": 1e-5, "model_type": "kimi_k25_vision",
          # transformers' names beside them: its Kimi_K25VisionConfig reads only its own and would
          # take the released model's defaults (1152 wide, 27 layers) for a tiny tower
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "pos_emb_height": 8, "pos_emb_width": 8,
          "pos_emb_time": 4}  # fmt: skip
TO_ORIGINAL = (  # transformers' module names → the checkpoint's (the renames, reversed)
    (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"^model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$",
     "vision_tower.patch_embed.pos_emb.weight"),
    (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
    (r"^model\.mm_projector\.", "mm_projector."),
)  # fmt: skip
MEDIA = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
MEDIA_PROC_CFG = {"in_patch_limit": 16384, "patch_size": VISION["patch_size"],
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "merge_kernel_size": 2, "fixed_output_tokens": None,
                  "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
                  "in_patch_limit_video": None, "sample_fps": 2.0,
                  "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
                  "timestamp_mode": "hh:mm:ss.fff"}  # fmt: skip
QKV = re.compile(r"^model\.vision_tower\.layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")


def vision_tensors(text_config: dict) -> dict[str, torch.Tensor]:
    """The vision tower and projector of transformers' Kimi_K25 model, original names, BF16."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    vision = {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4,
              "num_attention_heads": 2, "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "merge_kernel_size": [2, 2]}  # fmt: skip
    cfg = Kimi_K25Config(text_config=text_config, vision_config=vision, projection_hidden_size=64,
                         tie_word_embeddings=False)  # fmt: skip
    state = Kimi_K25ForConditionalGeneration(cfg).state_dict()
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for i, (name, p) in enumerate(sorted(state.items())):
        if not name.startswith(("model.vision_tower.", "model.mm_projector.")):
            continue
        x = DRAW.normal(SEED + i, p.shape)
        x = (
            0.02 * x
            if name.endswith("bias")
            else (1 + 0.1 * x if p.ndim == 1 else x / math.sqrt(p[0].numel()))
        )
        if hit := QKV.match(name):  # q, k, v stored as one wqkv (its rope row order is moot here)
            qkv.setdefault((hit.group(1), hit.group(3)), {})[hit.group(2)] = x
            continue
        for pattern, repl in TO_ORIGINAL:
            if re.search(pattern, name):
                out[re.sub(pattern, repl, name)] = x.to(torch.bfloat16)
                break
        else:
            raise KeyError(f"no original name for {name}")
    for (block, key), parts in qkv.items():
        wqkv = torch.cat([parts["q"], parts["k"], parts["v"]])
        out[f"vision_tower.encoder.blocks.{block}.wqkv.{key}"] = wqkv.to(torch.bfloat16)
    return out


def write_checkpoint(out: Path) -> Path:
    """The tiny K2 Thinking checkpoint under ``language_model.``, plus the vision tower."""
    k2 = out.parent / (out.name + "-k2")
    K2.write_checkpoint(k2, "thinking")
    index = json.loads((k2 / "model.safetensors.index.json").read_text())
    text_cfg = json.loads((k2 / "config.json").read_text())
    qc = text_cfg["quantization_config"]
    qc["ignore"] = [("language_model.lm_head" if i == "lm_head" else i) for i in qc["ignore"]]
    qc["ignore"] += ["re:vision_tower.*", "re:mm_projector.*"]  # the names under language_model.
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file

    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {("language_model." + n): t for n, t in load_file(str(k2 / shard)).items()}
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    vision = vision_tensors({k: v for k, v in text_cfg.items() if k != "quantization_config"})
    save_file(vision, str(out / "model-vision.safetensors"), metadata={"format": "pt"})
    weight_map |= dict.fromkeys(vision, "model-vision.safetensors")
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    for f in k2.iterdir():  # tokenizer, chat template, remote-code stand-ins, generation config
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            (out / f.name).write_bytes(f.read_bytes())
        f.unlink()
    k2.rmdir()
    pad = _media_tokens(out)["<|media_pad|>"]
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text_cfg, "vision_config": VISION, "tie_word_embeddings": False,
              "media_placeholder_token_id": pad}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n"
    )
    return out


def _media_tokens(out: Path) -> dict[str, int]:
    """K2's first reserved specials renamed to K2.5's media tokens (tokenizer files in ``out``);
    their ids."""
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    decoder = cfg["added_tokens_decoder"]
    reserved = [i for i, t in decoder.items() if t["content"].startswith("<|reserved_token_")]
    code = (out / "tokenization_kimi.py").read_text()
    ids = {}
    for token, i in zip(MEDIA, sorted(reserved, key=int), strict=False):
        code = code.replace(repr(decoder[i]["content"]), repr(token))
        decoder[i]["content"], ids[token] = token, int(i)
    (out / "tokenization_kimi.py").write_text(code)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    write_checkpoint(ap.parse_args().out)


if __name__ == "__main__":
    main()
