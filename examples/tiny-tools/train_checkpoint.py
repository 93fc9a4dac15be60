"""``train.py``'s checkpoint: the trained float state in DeepSeek's dtypes and shard layout.

``num_hidden_layers + 2`` shards: embed + layer 0 → 1, layer L → L + 1, MTP decoder + norm +
head → n + 1, MTP extras → n + 2, with one weight/scale pair split each way (``shard_of``).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import torch

from hetquant.formats.families import ModelConfig, expected_tensors
from hetquant.formats.fp8_block import Fp8Block

__all__ = ["shard_of", "shipped_tensors", "write_checkpoint"]

common = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("common.py"))))
FP8 = Fp8Block()


def shipped_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek's dtypes, from hetquant's role table: FP8 + F32 scale for every linear but the
    MTP ``eh_proj`` (BF16 in DeepSeek's checkpoint), F32 router bias, BF16 for the rest."""
    roles = expected_tensors(cfg)
    if set(state) != set(roles):
        extra, missing = sorted(set(state) - set(roles)), sorted(set(roles) - set(state))
        raise SystemExit(f"state does not match the role table: extra {extra}, missing {missing}")
    out = {}
    for name, role in roles.items():
        t = state[name]
        if tuple(t.shape) != role.shape:
            raise SystemExit(f"{name}: shape {tuple(t.shape)}, role table says {role.shape}")
        if role.role.kind == "linear" and role.role.name != "mtp_eh_proj":
            q = FP8.quantize(t)
            out[name], out[f"{name}_scale_inv"] = q["weight"], q["weight_scale_inv"]
        elif role.role.kind == "bias":
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def shard_of(name: str, cfg: ModelConfig) -> int:
    """1-based shard: embed + layer 0 → 1, layer L → L + 1, MTP decoder + norm + head → n + 1,
    MTP extras → n + 2 (n = num_hidden_layers). Two pairs split on purpose: layer 0's
    ``kv_a_proj_with_mqa`` scale lives in shard 2 (after its weight), the last main layer's last
    expert ``down_proj.weight`` in shard n + 1 (after its scale)."""
    n = cfg.num_hidden_layers
    if name == "model.embed_tokens.weight":
        return 1
    if name in ("model.norm.weight", "lm_head.weight"):
        return n + 1
    layer = int(name.split(".")[2])
    sub = name.split(".", 3)[3]
    if layer >= n:
        return n + 2 if sub.split(".")[0] in common.MTP_EXTRAS else n + 1
    if layer == 0 and sub == "self_attn.kv_a_proj_with_mqa.weight_scale_inv":
        return 2
    if layer == n - 1 and sub == f"mlp.experts.{cfg.n_routed_experts - 1}.down_proj.weight":
        return n + 1
    return layer + 1


def write_checkpoint(
    out: Path, config: dict, state: dict[str, torch.Tensor], tokenizer_json: str
) -> dict[str, int]:
    """Every checkpoint file of ``state`` into ``out``; {file name: bytes}."""
    cfg = ModelConfig.from_dict(config)
    if cfg.num_hidden_layers < 2 or not cfg.is_moe_layer(cfg.num_hidden_layers - 1):
        raise SystemExit("write_checkpoint: needs >= 2 layers, the last one MoE")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tok_cfg = {**common.TOKENIZER_CONFIG, "model_max_length": config["max_position_embeddings"]}
    return common.write_checkpoint_files(
        out, shipped_tensors(state, cfg), lambda name: shard_of(name, cfg),
        cfg.num_hidden_layers + 2, config, tok_cfg,
    )  # fmt: skip
