"""Train a small DeepSeek-V3-architecture model on CPython's docs; ship it as DeepSeek ships V3.

The random-weight ``tiny-deepseek-v3`` beside this script produces noise; this script produces a
*trained* checkpoint of the same architecture family, whose activations (outliers, attention
sinks, skewed expert loads) look like a real model's — what quantization recipes need to be
measured on. Output (``--out``, default ``examples/tiny-deepseek-v3-trained/``): block-FP8
(E4M3 + F32 ``weight_scale_inv``, ``Fp8Block().quantize``) linears, BF16 norms / embeddings /
router / MTP ``eh_proj``, F32 ``e_score_correction_bias``, the MTP layer with its extras (embed
and head as copies), ``num_hidden_layers + 2`` shards with one scale in a later shard than its
weight and one weight in a later shard than its scale, the index, ``config.json`` with every key
of the real one (``make_tiny.CONFIG``), tokenizer files, ``generation_config.json``, and a
README with the run's facts (corpus sha256, steps, losses, held-out perplexities, checks).

Model (``FULL``): hidden 384, vocab 4096 (byte-level BPE retrained on the training text, as
make_tiny.py does, DeepSeek's special tokens at 0/1/2), 4 layers (layer 0 dense, intermediate
1024; layers 1-3 MoE: 16 routed experts of intermediate 128 + 1 shared, top-2 of 4 groups /
2 kept, sigmoid, ``noaux_tc``, scale 2.5), MLA with 8 heads, q_lora 256, kv_lora 128,
qk_nope 64, qk_rope 32, v 64 (``kv_a_proj_with_mqa``: 160 rows, a partial 128-block), YaRN ×4
over 1024; one MTP layer (MoE). 14.6 M parameters in the main model (8.4 M active per token),
3.5 M more in the MTP layer; 27.9 MB of tensors (FP8 linears 14.6 MB, BF16 13.2 MB of which
12.6 MB are the embedding, head and their MTP copies), 28.2 MB with the tokenizer. Hidden 384
rather than 512 keeps the checkpoint under 30 MB: at 512 the four [4096, H] BF16 matrices alone
take 16.8 MB.

Training: a batched module (``Model``) equivalent to ``hetquant.runtime.forward.model`` — tokens sorted
by expert, one matmul pair per expert — trained with AdamW (fp32 master weights, bf16 autocast
on CUDA), next-token loss + 0.3 × the MTP loss (DeepSeek-V3's λ for most of its pre-training),
and DeepSeek's auxiliary-loss-free balancing: after every step each MoE layer's
``e_score_correction_bias += γ · sign(mean_load − load)`` (γ = 1e-3, MTP layer included). The
MTP layer follows vLLM / SGLang's DeepSeek MTP: ``eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])``
with ``h_i`` the main model's *final-normed* hidden state, one decoder layer, ``shared_head``
(norm + head) on its output, predicting ``t_{i+2}``; its embedding and head are the main
model's. Samples are ``[BOS] + 512`` tokens of the text, non-overlapping windows at a random
offset per epoch, shuffled (``--seed``).

After training, mandatory check: ``DeepseekV3Reference(cfg, DenseWeights(trained fp32 state))``
from ``hetquant.runtime.forward.model`` gives the training module's logits within float32
summation-order tolerance (the run stops before writing otherwise). Then the checkpoint is
written, read back through ``hetquant.convert.planning.source.SourceCheckpoint``, dequantized with
DeepSeek's formula, and the held-out perplexity of (a) the float model (training module, fp32)
and (b) the FP8 checkpoint through the runtime reference are printed and written.

Length: ``--steps N`` is exact and deterministic given ``--seed`` and the device. Without it the
run ends after ``--minutes`` of training (default 8) or ``--max-epochs`` passes over the text
(default 10: 2.7 M training tokens is little for 18 M parameters, more passes overfit — the
README's held-out curve shows it), whichever comes first. The step count is fixed once, from the
timing of steps 5-24, inside the warm-up whose schedule does not depend on it, so the run equals
``--steps`` of that count, which the README records. On CUDA,
``torch.use_deterministic_algorithms(True, warn_only=True)`` and no TF32; kernels without a
deterministic variant (SDPA's backward) warn and may differ in the last bits between runs.

Files: this script (configuration, the training loop, the report), ``train_model.py`` (the
training module), ``train_data.py`` (tokens, windows, batches), ``train_eval.py`` (the runtime
check, held-out NLL, reading the checkpoint back), ``train_checkpoint.py`` (DeepSeek's dtypes and
shards), ``train_report.py`` (the README) and ``common.py`` (shared with make_tiny.py: the
tokenizer trainer, config keys, file writing).

The training text depends on the machine (Python version for ``pydoc_data``, Debian's
``python3-doc`` for the HTML manual; see corpus.py). For a GPU box without python3-doc, export
the corpus here and pass it along::

    python examples/tiny-tools/corpus.py --export corpus-export   # here, with python3-doc
    python examples/tiny-tools/train.py --device cuda --corpus corpus-export
    python examples/tiny-tools/train.py --smoke --out /tmp/smoke   # 20 CPU steps, tiny dims
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import runpy
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
common = SimpleNamespace(**runpy.run_path(str(HERE / "common.py")))  # shared with make_tiny.py
conf, corpus, data, checks, ckpt, report = map(
    common.sibling,
    ("train_config", "corpus", "train_data", "train_eval", "train_checkpoint", "train_report"),
)
Model = common.sibling("train_model").Model
Hyper = conf.Hyper
read_checkpoint, summation_tolerance = checks.read_checkpoint, checks.summation_tolerance


@dataclass
class Result:
    out: Path
    model: Model  # trained, on the training device
    config: dict
    losses: list[float] = field(default_factory=list)
    mtp_losses: list[float] = field(default_factory=list)
    heldout: torch.Tensor | None = None  # evaluation samples [n, T+1]
    report: dict = field(default_factory=dict)


@torch.no_grad()
def init_weights(model: Model, seed: int, std: float) -> None:
    """N(0, std) from ``common.noise`` (integer draws: the same on every platform); outputs of
    residual branches (``kind == "out"``) std / sqrt(2 · layers); norms stay 1."""
    out_std = std / math.sqrt(2 * model.cfg.total_layers)
    for name, shape, kind in model.param_specs():
        if kind != "norm":
            model.w(name).copy_(
                common.noise(seed, name, shape).float() * (out_std if kind == "out" else std)
            )


def lr_at(step: int, total: int, h: Hyper) -> float:
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = min(1.0, (step - h.warmup) / max(1, total - h.warmup))
    return h.lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Model, h: Hyper, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for k, p in model.p.items() if p.ndim >= 2]
    no_decay = [p for k, p in model.p.items() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": h.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=h.lr, betas=h.betas, eps=1e-8, fused=device.type == "cuda")


def log(msg: str) -> None:
    print(msg, flush=True)


def run(argv: list[str] | None = None) -> Result:
    args = conf.parse_args(argv, __doc__.split("\n\n")[0])
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: list[str] | None) -> Result:
    h = copy.deepcopy(conf.SMOKE_HYPER if args.smoke else Hyper())
    for k in ("lr", "batch", "seq_len", "warmup", "max_epochs", "eval_every"):
        if getattr(args, k) is not None:
            setattr(h, k, getattr(args, k))
    device = _device(args.device)
    t_start = time.time()
    texts, tokenizer_json, train_stream, heldout, same_heldout = _tokens(args, h, t_start)
    config = conf.model_config(conf.SMOKE if args.smoke else conf.FULL, h.vocab)
    torch.manual_seed(args.seed)
    model = Model(config)
    init_weights(model, args.seed, h.init_std)
    model = model.to(device)
    result = Result(out=args.out, model=model, config=config, heldout=heldout)
    batches = data.Batches(train_stream, h.seq_len, h.batch, args.seed)
    evals, steps, train_s = _train(model, batches, h, args, device, result)
    run_facts = {
        "texts": texts, "tokenizer_json": tokenizer_json, "train_stream": train_stream,
        "same_heldout": same_heldout, "evals": evals, "steps": steps, "train_s": train_s,
        "epoch_steps": batches.steps_per_epoch, "argv": argv,
    }  # fmt: skip
    result.report = _finish(result, h, args, device, run_facts)
    log(
        f"held-out ppl: float {result.report['heldout_ppl_float']:.3f}, "
        f"FP8 checkpoint via runtime {result.report['heldout_ppl_fp8_runtime']:.3f}; "
        f"{result.report['checkpoint_bytes']:,} bytes in {args.out} [{time.time() - t_start:.0f}s total]"
    )
    return result


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def _tokens(args: argparse.Namespace, h: Hyper, t_start: float) -> tuple:
    """(texts, tokenizer JSON, training stream [n], held-out windows [w, T+1], whether the
    held-out text is the committed heldout.txt)."""
    texts = corpus.load(args.corpus, use_html=not (args.no_html or args.smoke))
    log(f"corpus: train {len(texts.train):,} chars, held-out {len(texts.heldout):,} chars")
    if not args.smoke and "python3-doc" not in texts.describe["sources"]:
        log(
            "WARNING: training on pydoc_data.topics alone (no python3-doc here): a few hundred KB; "
            "export the corpus where python3-doc is installed and pass --corpus"
        )
    committed, same_heldout = HERE / "heldout.txt", None
    if not args.smoke and committed.is_file():
        same_heldout = committed.read_text(encoding="utf-8") == texts.heldout
        log(f"held-out text {'=' if same_heldout else '!='} {committed}")
    tokenizer_json = common.train_tokenizer(data.paragraphs(texts.train), h.vocab)
    train_stream = data.encode(tokenizer_json, texts.train)
    held_stream = data.encode(tokenizer_json, texts.heldout)
    heldout = data.windows(held_stream, h.seq_len)
    if args.eval_windows:
        heldout = heldout[: args.eval_windows]
    log(
        f"tokens: train {train_stream.numel():,}, held-out {held_stream.numel():,} "
        f"({heldout.shape[0]} windows of {h.seq_len}) [{time.time() - t_start:.0f}s]"
    )
    return texts, tokenizer_json, train_stream, heldout, same_heldout


def _train(model: Model, batches, h: Hyper, args: argparse.Namespace, device, result: Result):
    """The training loop: (held-out evaluations [(step, nll)], steps, seconds).

    Without ``--steps`` the step count is fixed from the timing of steps 5-24 (inside the
    warm-up, whose schedule does not depend on it) to fit ``--minutes``, capped by the epochs.
    """
    opt = make_optimizer(model, h, device)
    epoch_steps = batches.steps_per_epoch
    cap = max(1, int(h.max_epochs * epoch_steps))
    total = args.steps if args.steps else cap
    probe = (5, 25) if not args.steps else None
    if args.compile:
        model.attention = torch.compile(model.attention)  # type: ignore[method-assign]
    log(f"training: {epoch_steps} steps/epoch, cap {cap} steps, device {device}")
    mtp = bool(result.config["num_nextn_predict_layers"])
    evals: list[tuple[int, float]] = []
    t_train, t_probe, step = time.time(), None, 0
    while step < total:
        if probe and step == probe[0]:
            _sync(device)
            t_probe = time.time()
        if probe and step == probe[1] and t_probe is not None:
            _sync(device)
            per_step = (time.time() - t_probe) / (probe[1] - probe[0])
            remaining = args.minutes * 60 - (time.time() - t_train)
            total = max(probe[1], min(cap, probe[1] + int(0.95 * remaining / per_step)))
            log(f"probe: {per_step * 1000:.1f} ms/step -> {total} steps")
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, h)
        _step(model, opt, batches.next().to(device, non_blocking=True), h, mtp, result)
        step += 1
        if step % h.eval_every == 0 or step == total:
            ev = checks.module_nll(model, result.heldout, device, bf16=device.type == "cuda")
            evals.append((step, ev))
            mtp_loss = result.mtp_losses[-1] if result.mtp_losses else 0
            log(
                f"step {step}/{total} epoch {batches.epoch} lr {lr_at(step - 1, total, h):.2e} "
                f"loss {result.losses[-1]:.3f} mtp {mtp_loss:.3f} "
                f"held-out {ev:.3f} (ppl {math.exp(ev):.1f}) [{time.time() - t_train:.0f}s]"
            )
    _sync(device)
    return evals, step, time.time() - t_train


def _step(model: Model, opt, batch: torch.Tensor, h: Hyper, mtp: bool, result: Result) -> None:
    """One optimizer step on ``batch`` [B, T+1]: next-token loss + λ · MTP loss, then the
    auxiliary-loss-free bias update; the losses are appended to ``result``."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with checks.autocast(batch.device):
        logits, mtp_logits = model(inputs, mtp=mtp)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    total_loss = loss
    if mtp_logits is not None:
        mtp_loss = F.cross_entropy(mtp_logits.float().flatten(0, 1), targets[:, 1:].flatten())
        total_loss = loss + h.mtp_weight * mtp_loss
        result.mtp_losses.append(mtp_loss.item())
    opt.zero_grad(set_to_none=True)
    total_loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
    opt.step()
    model.update_bias(h.bias_rate)
    result.losses.append(loss.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _finish(result: Result, h: Hyper, args: argparse.Namespace, device, f: dict) -> dict:
    """The runtime check (the run stops before writing if it fails), the checkpoint, both
    held-out perplexities, and the report (also written as the checkpoint's README)."""
    model, config, heldout = result.model, result.config, result.heldout
    model.eval()
    verify = checks.verify_runtime(model, heldout[: args.verify_windows])
    log(f"runtime check (float weights): {verify}")
    if not verify["ok"]:
        raise SystemExit("runtime/forward/model.py disagrees with the training module; not writing")
    state = model.hf_state()
    sizes = ckpt.write_checkpoint(args.out, config, state, f["tokenizer_json"])
    cfg_read, deq = read_checkpoint(args.out)
    float_nll = checks.module_nll(model, heldout, device)
    fp8_nll = checks.runtime_nll(cfg_read, deq, heldout)
    f.update(dims=conf.SMOKE if args.smoke else conf.FULL, model=model, config=config,
             heldout=heldout, hyper=h, args=args, device=device, losses=result.losses,
             mtp_losses=result.mtp_losses, verify=verify, state=state, sizes=sizes,
             float_nll=float_nll, fp8_nll=fp8_nll)  # fmt: skip
    doc = report.make_report(f)
    (args.out / "README.md").write_text(report.readme(doc), encoding="utf-8")
    return doc


def main() -> None:
    run()


if __name__ == "__main__":
    main()
