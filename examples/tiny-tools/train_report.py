"""``train.py``'s record of a run: the report (``make_report``) and the README written from it
beside the checkpoint (``readme``)."""

from __future__ import annotations

import hashlib
import math
import platform
import sys

import torch

from hetquant.formats.families import ModelConfig

__all__ = ["make_report", "param_counts", "readme"]


def readme(r: dict) -> str:
    d, p, c, h = r["dims"], r["params"], r["corpus"], r["hyper"]
    sources = ", ".join(
        f"`{k}` ({v['documents']} docs, sha256 {v['sha256'][:16]}…)"
        for k, v in c["sources"].items()
    )
    held = {
        True: "the same text as",
        False: "NOT the same text as (other corpus sources)",
        None: "not compared with",
    }
    mtp_loss = r["final_mtp_loss_mean_last_10"]
    n_layers, n_shards = d["num_hidden_layers"], len(r["files"]) - 5
    lines = [
        "# tiny-deepseek-v3-trained",
        "",
        "A small model with DeepSeek-V3's architecture, **trained** on CPython's documentation,",
        "shipped file for file as DeepSeek ships V3 / R1: block-FP8 (E4M3, 128×128, F32",
        "`weight_scale_inv`) linears, BF16 norms / embeddings / router / MTP `eh_proj`, F32",
        f"`e_score_correction_bias`, the MTP layer with its extras, {n_shards} shards with",
        "weight/scale pairs split across shards both ways, the index, every key of the real",
        "`config.json`. Written, this file included, by `examples/tiny-tools/train.py`.",
        "",
        "| | |",
        "|---|---|",
        f"| hidden / vocab | {d['hidden_size']} / {h['vocab']} (byte-level BPE trained on the "
        "training text, DeepSeek's special tokens) |",
        f"| layers | {n_layers}: {d['first_k_dense_replace']} dense (intermediate "
        f"{d['intermediate_size']}), the rest MoE; MTP layer `model.layers.{n_layers}` |",
        f"| MLA | {d['num_attention_heads']} heads, q_lora {d['q_lora_rank']}, kv_lora "
        f"{d['kv_lora_rank']}, qk_nope {d['qk_nope_head_dim']}, qk_rope "
        f"{d['qk_rope_head_dim']}, v {d['v_head_dim']} |",
        f"| MoE | {d['n_routed_experts']} routed experts (intermediate "
        f"{d['moe_intermediate_size']}), {d['n_shared_experts']} shared, "
        f"top-{d['num_experts_per_tok']}, {d['n_group']} groups / top-{d['topk_group']}, "
        "`noaux_tc`, sigmoid, scale 2.5 |",
        f"| parameters | {p['main']:,} main ({p['main_active_per_token']:,} active per token), "
        f"{p['mtp_own']:,} MTP-only; {p['stored_incl_mtp_copies']:,} stored (MTP copies of "
        "embed / head included) |",
        f"| checkpoint | {r['checkpoint_bytes']:,} bytes |",
        "",
        "## Held-out perplexity",
        "",
        "| model | NLL | perplexity |",
        "|---|---|---|",
        f"| float32 weights, training module | {r['heldout_nll_float']:.4f} | "
        f"{r['heldout_ppl_float']:.3f} |",
        "| this FP8 checkpoint, dequantized, `hetquant.runtime.forward.model.DeepseekV3Reference` | "
        f"{r['heldout_nll_fp8_runtime']:.4f} | {r['heldout_ppl_fp8_runtime']:.3f} |",
        "",
        f"{r['heldout_tokens_evaluated']:,} held-out tokens in windows of {h['seq_len']} "
        "(BOS + text) from documents never trained on; "
        f"{held[r['heldout_is_committed_heldout_txt']]} "
        "`examples/tiny-tools/heldout.txt` (`corpus.py --write-heldout`).",
        "Runtime check on the float weights (mandatory; the run stops otherwise): "
        f"{r['runtime_check']}.",
        "",
        "## Training",
        "",
        f"- Text: {sources}; training text {c['train']['bytes']:,} bytes, sha256 "
        f"`{c['train']['sha256']}`; held-out {c['heldout']['bytes']:,} bytes, sha256 "
        f"`{c['heldout']['sha256']}`; split: {c['split']}.",
        f"- {r['steps']} steps ({r['epochs']} epochs of {r['train_tokens']:,} tokens) of "
        f"{h['batch']} × {h['seq_len']} tokens in {r['train_seconds']} s on {r['device']}, "
        f"torch {r['torch']}, Python {r['python']}, seed {r['seed']}.",
        f"- AdamW (β {h['betas']}, weight decay {h['weight_decay']} on matrices), peak lr "
        f"{h['lr']}, {h['warmup']} warm-up steps, cosine to {h['min_lr_ratio']}×, grad clip "
        f"{h['grad_clip']}; fp32 master weights, bf16 autocast on CUDA.",
        f"- Loss: next token + {h['mtp_weight']} × MTP (token i+2 from the final-normed h_i and "
        "embed(t_(i+1)), vLLM's DeepSeek MTP convention).",
        f"- Aux-loss-free balancing: `e_score_correction_bias += {h['bias_rate']} · "
        "sign(mean_load − load)` after each step; max |bias| per layer at the end: "
        f"{r['expert_bias_absmax']}.",
        f"- Loss {r['first_loss']:.3f} at step 1, {r['final_loss_mean_last_10']:.3f} over the "
        f"last 10 steps (MTP {mtp_loss if mtp_loss is None else round(mtp_loss, 3)}).",
        f"- Tokenizer sha256 `{r['tokenizer_sha256']}`.",
        f"- Reproduce: `{r['command']}` with `--steps {r['steps']}` (exact on the same device; "
        "see train.py on GPU determinism).",
        "",
        "| step | held-out NLL (bf16 on CUDA) | perplexity |",
        "|---|---|---|",
        *(f"| {step} | {v:.3f} | {math.exp(v):.2f} |" for step, v in r["evals"]),
        "",
        "## Files",
        "",
        "| file | bytes |",
        "|---|---|",
        *(f"| `{f}` | {n:,} |" for f, n in r["files"].items()),
    ]
    return "\n".join(lines) + "\n"


def make_report(f: dict) -> dict:
    """The facts of a run (``f``: what train.py's ``_finish`` collected) as the report dict."""
    model, h, args, device, config = f["model"], f["hyper"], f["args"], f["device"], f["config"]
    step, losses, mtp_losses, argv = f["steps"], f["losses"], f["mtp_losses"], f["argv"]
    heldout, state, sizes = f["heldout"], f["state"], f["sizes"]
    float_nll, fp8_nll, verify = f["float_nll"], f["fp8_nll"], f["verify"]
    return {
        "dims": f["dims"],
        "hyper": {k: getattr(h, k) for k in h.__dataclass_fields__},
        "seed": args.seed,
        "device": str(device)
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": step,
        "epochs": round(step / f["epoch_steps"], 2),
        "train_seconds": round(f["train_s"], 1),
        "tokens_seen": step * h.batch * h.seq_len,
        "train_tokens": int(f["train_stream"].numel()),
        "heldout_tokens_evaluated": int(heldout[:, 1:].numel()),
        "heldout_is_committed_heldout_txt": f["same_heldout"],
        "first_loss": losses[0],
        "final_loss_mean_last_10": sum(losses[-10:]) / len(losses[-10:]),
        "final_mtp_loss_mean_last_10": (
            sum(mtp_losses[-10:]) / len(mtp_losses[-10:]) if mtp_losses else None
        ),
        "evals": f["evals"],
        "heldout_nll_float": float_nll,
        "heldout_ppl_float": math.exp(float_nll),
        "heldout_nll_fp8_runtime": fp8_nll,
        "heldout_ppl_fp8_runtime": math.exp(fp8_nll),
        "runtime_check": verify,
        "expert_bias_absmax": {
            layer: float(model.bias(layer).abs().max()) for layer in model.moe_layers
        },
        "params": param_counts(state, ModelConfig.from_dict(config)),
        "files": sizes,
        "checkpoint_bytes": sum(sizes.values()),
        "corpus": f["texts"].describe,
        "tokenizer_sha256": hashlib.sha256(f["tokenizer_json"].encode()).hexdigest(),
        "command": "python examples/tiny-tools/train.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }


def param_counts(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, int]:
    main = {n: t for n, t in state.items() if not _is_mtp(n, cfg)}
    mtp_own = {
        n: t
        for n, t in state.items()
        if _is_mtp(n, cfg) and not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))
    }
    routed = sum(t.numel() for n, t in main.items() if ".mlp.experts." in n)
    per_expert = routed // max(
        1,
        cfg.n_routed_experts
        * len([i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]),
    )
    k = int(cfg.raw["num_experts_per_tok"])
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    total_main = sum(t.numel() for t in main.values())
    return {
        "main": total_main,
        "main_active_per_token": total_main - routed + n_moe * k * per_expert,
        "mtp_own": sum(t.numel() for t in mtp_own.values()),
        "stored_incl_mtp_copies": sum(t.numel() for t in state.values()),
    }


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_hidden_layers
