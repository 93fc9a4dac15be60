"""``train.py``'s configurations: the model dims (``FULL``: the committed trained model;
``SMOKE``: seconds on a CPU) and the training hyper-parameters."""

from __future__ import annotations

import argparse
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

__all__ = ["FULL", "SMOKE", "SMOKE_HYPER", "Hyper", "model_config", "parse_args"]

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "tiny-deepseek-v3-trained"
common = SimpleNamespace(**runpy.run_path(str(HERE / "common.py")))

FULL = {  # dims of the committed trained model (see module docstring)
    "hidden_size": 384,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "num_nextn_predict_layers": 1,
}
SMOKE = {  # a few seconds on a laptop CPU
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "num_nextn_predict_layers": 1,
}


@dataclass
class Hyper:
    vocab: int = 4096
    seq_len: int = 512
    batch: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3  # DeepSeek-V3's λ for the first 10T tokens
    bias_rate: float = 1e-3  # DeepSeek-V3's γ for the first 14.3T tokens
    init_std: float = 0.02  # config initializer_range
    max_epochs: float = 10.0  # the text is small: more passes overfit (see the README's curve)
    eval_every: int = 100


SMOKE_HYPER = Hyper(
    vocab=640, seq_len=64, batch=8, lr=3e-3, warmup=3, max_epochs=1e9, eval_every=10
)


def model_config(dims: dict, vocab: int) -> dict:
    """The full HF config.json (every key of DeepSeek-V3's) for ``dims``."""
    return {**common.CONFIG, **dims, "vocab_size": vocab}


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """train.py's command line (``--smoke``: tiny dims, CPU, 20 steps, one thread)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="default: cuda when available (--smoke: cpu)",
    )
    ap.add_argument("--minutes", type=float, default=8.0, help="training-loop budget")
    ap.add_argument("--steps", type=int, help="exact step count (overrides --minutes)")
    ap.add_argument("--max-epochs", type=float, help="cap on passes over the training text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, help="a corpus.py --export folder (else built here)")
    ap.add_argument("--no-html", action="store_true", help="pydoc_data.topics only")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--eval-windows", type=int, help="held-out windows to evaluate (default all)")
    ap.add_argument("--verify-windows", type=int, default=4)
    ap.add_argument("--compile", action="store_true", help="torch.compile the attention")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; smoke: 1)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, CPU, 20 steps")
    args = ap.parse_args(argv)
    if args.smoke:
        if "--device" not in (argv if argv is not None else sys.argv[1:]):
            args.device = "cpu"
        args.steps = args.steps or 20
        args.eval_windows = args.eval_windows or 8
        args.verify_windows = min(args.verify_windows, 2)
        args.threads = args.threads or 1
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    return args
