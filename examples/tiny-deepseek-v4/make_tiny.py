"""Write a tiny random DeepSeek-V4, built with transformers' own classes, in two layouts.

``--layout deepseek`` (default): DeepSeek's own checkpoint, as DeepSeek-V4-Flash ships it —
``layers.N.attn.wq_a``, ``embed.weight``, ``head.weight``, ``hc_head_fn``, the MTP layer under
``mtp.0.``; the attention linears, the indexer's ``wq_b``, the shared experts and the MTP
``e_proj`` / ``h_proj`` in 128×128 block FP8 with UE8M0 ``scale`` (``fp8_block_scale``), the
routed experts in FP4 (``fp4_e2m1``), the compressors, ``weights_proj``, the router, embeddings
and norms BF16, hyper-connections, ``ape``, ``attn_sink`` and the router bias F32, ``tid2eid``
I32; config.json in DeepSeek's keys (``compress_ratios``, ``num_hash_layers``, ``expert_dtype``,
``quantization_config`` with ``scale_fmt: ue8m0``). ``--layout transformers``: the same BF16
weights (FP4 / FP8 already applied, so both layouts hold one model) through
``DeepseekV4ForCausalLM.save_pretrained`` (``model.`` prefix, ``model.embed_tokens``, no MTP).

The model has all three attention types (sliding, compressed sparse with the indexer, heavily
compressed), a hash-routed and top-k MoE layers, one MTP layer (synthesized: transformers does not
build it). ``to_deepseek`` is the exact inverse of transformers' names for this model: a BF16
DeepSeek-layout copy loads back into ``DeepseekV4ForCausalLM`` through transformers' own
``conversion_mapping`` with an identical state dict (the generator's test checks it).

``--dims vllm``: the same model at the attention dimensions vLLM 0.32's CPU build serves (V4's
own): head_dim 512 (``compressor.py:295-314``; ``flash_mla_with_kvcache_cpu: q must be
[num_tokens, num_heads, 512]`` in ``_C.abi3.so``), rope dim 64 (``cpu/cpu_sparse.py:41``
``_ROPE_DIM``, which ``_o_proj`` un-ropes with), index_head_dim 128 (``compressor.py:304``;
``fp8_paged_mqa_logits_cpu: q_fp8 head_dim must be 128``), index_topk 512
(``model_executor/layers/sparse_attn_indexer.py:1234``: ``topk_transform_512_cpu``), 64 routed
experts, top-6 (``hash_topk_cpu`` / ``biased_topk_cpu`` in ``_C.abi3.so`` take 64, 128, 256 or
384 experts: "unsupported num_experts 8"); the rest stays tiny. config.json
carries ``hc_eps``, ``hc_sinkhorn_iters`` and ``hidden_act`` (transformers' defaults), as the
released V4 configs do and vLLM's V4 reads without a default (``cpu/model.py:264-266``), and
``topk_method: noaux_tc``, without which vLLM has no parameter for the router's bias
(``cpu/model.py:163-167``).

Every tensor is drawn from one seeded generator (SEED, the tensor's position;
``tiny-tools/draw.py``), so a run writes the same bytes on every CPU. Usage::

    python examples/tiny-deepseek-v4/make_tiny.py OUT [--layout deepseek|transformers]
        [--dims tiny|vllm]
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from hetquant.formats import get_format

HERE = Path(__file__).resolve().parent
DRAW = SimpleNamespace(**runpy.run_path(str(HERE.parent / "tiny-tools" / "draw.py")))
TOKENIZER_DIR = HERE.parent / "tiny-deepseek-v3"
SEED = 20260424
LAYERS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention")  # fmt: skip
RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4,
         "heavily_compressed_attention": 128}  # fmt: skip
HASH_LAYERS = 1
DIMS = dict(vocab_size=640, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, head_dim=64, q_lora_rank=64, num_experts_per_tok=2,
            n_routed_experts=8, n_shared_experts=1, o_groups=2, o_lora_rank=32, index_n_heads=2,
            index_head_dim=32, index_topk=4, sliding_window=8, hc_mult=2,
            num_nextn_predict_layers=1, rms_norm_eps=1e-6, routed_scaling_factor=1.5,
            scoring_func="sqrtsoftplus", norm_topk_prob=True, swiglu_limit=10.0,
            bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)  # fmt: skip
ROPE_DIM = 16  # qk_rope_head_dim: partial_rotary_factor · head_dim
# --dims: overrides of DIMS (module docstring); "rope_dim" replaces ROPE_DIM
VARIANTS = {"tiny": {}, "vllm": {"head_dim": 512, "index_head_dim": 128, "rope_dim": 64,
                                 "n_routed_experts": 64, "num_experts_per_tok": 6,
                                 "index_topk": 512}}  # fmt: skip
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}  # fmt: skip
FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
                 r"|\.shared_experts\.w[123]\.weight$|\.[eh]_proj\.weight$")  # fmt: skip
FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
F32 = re.compile(r"hc_|\.ape$|\.attn_sink$|\.gate\.bias$")
# transformers' save_pretrained names → DeepSeek's (the inverse of conversion_mapping.py
# "deepseek_v4" as this model's names need it; model_families / the family docstring say why)
TO_DEEPSEEK = ((r"^model\.embed_tokens\.", "embed."), (r"^model\.hc_head\.hc_", "hc_head_"),
               (r"^model\.", ""), (r"\.attn\.norm\.", ".attn.kv_norm."))  # fmt: skip


def _dims(variant: str) -> tuple[dict, int]:
    """DIMS with the variant's overrides, and its rope dim."""
    over = dict(VARIANTS[variant])
    rope = over.pop("rope_dim", ROPE_DIM)
    return {**DIMS, **over}, rope


def hf_config(variant: str = "tiny") -> object:
    from transformers import DeepseekV4Config

    d, rope = _dims(variant)
    return DeepseekV4Config(**d, layer_types=list(LAYERS), partial_rotary_factor=rope / d["head_dim"],
                            mlp_layer_types=["hash_moe"] * HASH_LAYERS
                            + ["moe"] * (len(LAYERS) - HASH_LAYERS))  # fmt: skip


def deepseek_config(variant: str = "tiny") -> dict:
    """config.json as DeepSeek writes it (its keys; transformers reads them as legacy kwargs)."""
    d, rope = _dims(variant)
    extra = {}
    if variant != "tiny":  # the released configs' keys vLLM needs (module docstring)
        hf = hf_config(variant)
        extra = {k: getattr(hf, k) for k in ("hc_eps", "hc_sinkhorn_iters", "hidden_act")}
        extra["topk_method"] = "noaux_tc"  # vLLM loads gate.bias only then (cpu/model.py:163)
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **d, **extra,
            "compress_ratios": [RATIO[t] for t in LAYERS], "num_hash_layers": HASH_LAYERS,
            "qk_rope_head_dim": rope, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "max_position_embeddings": 4096, "expert_dtype": "fp4", "quantization_config": QUANT,
            "torch_dtype": "bfloat16"}  # fmt: skip


def to_deepseek(name: str) -> str:
    for pattern, repl in TO_DEEPSEEK:
        name = re.sub(pattern, repl, name)
    return name


def _draw(name: str, shape: tuple[int, ...], index: int, experts: int) -> torch.Tensor:
    if name.endswith("tid2eid"):
        return torch.randint(
            0, experts, shape, generator=torch.Generator().manual_seed(SEED + index)
        )
    w = DRAW.normal(SEED + index, shape)
    if re.search(r"norm\.weight$", name):
        return 1.0 + 0.1 * w
    return w * (0.5 if F32.search(name) else 0.05)


def model_weights(variant: str = "tiny") -> dict[str, torch.Tensor]:
    """The model in DeepSeek's names, values already on the FP4 / FP8 grids (so that every
    layout holds the same model): main layers from transformers' module tree, then the MTP layer."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf_config(variant))
    names = {to_deepseek(n): tuple(p.shape) for n, p in _saved_names(model).items()}
    n = DIMS["num_hidden_layers"]
    for k, shape in list(names.items()):  # the MTP block: layer 0's sliding attention, top-k MoE
        if k.startswith("layers.1.") and ("ffn." in k or "hc_" in k or "_norm." in k):
            names[f"mtp.0.{k[len('layers.1.') :]}"] = shape
        elif k.startswith("layers.0.attn."):
            names[f"mtp.0.{k[len('layers.0.') :]}"] = shape
    h, hc = DIMS["hidden_size"], DIMS["hc_mult"]
    names.update({"mtp.0.enorm.weight": (h,), "mtp.0.hnorm.weight": (h,),
                  "mtp.0.e_proj.weight": (h, h), "mtp.0.h_proj.weight": (h, h),
                  "mtp.0.norm.weight": (h,), "mtp.0.hc_head_fn": (hc, hc * h),
                  "mtp.0.hc_head_base": (hc,), "mtp.0.hc_head_scale": (1,)})  # fmt: skip
    assert n == len(LAYERS)
    out = {}
    for i, (name, shape) in enumerate(sorted(names.items())):
        w = _draw(name, shape, i, _dims(variant)[0]["n_routed_experts"])
        if FP4.search(name):
            w = get_format("fp4_e2m1").dequantize(get_format("fp4_e2m1").quantize(w))
        elif FP8.search(name):
            w = get_format("fp8_block_scale").dequantize(get_format("fp8_block_scale").quantize(w))
        out[name] = w if name.endswith("tid2eid") else w.to(torch.bfloat16).float()
    return out


def _saved_names(model: object) -> dict[str, torch.Tensor]:
    """The names ``save_pretrained`` writes for ``model`` (its state dict with the conversion
    mapping reversed), from transformers' own reverse renaming."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def deepseek_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored tensors of DeepSeek's layout (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        prefix = name.rpartition(".")[0]
        if FP4.search(name):
            q = get_format("fp4_e2m1").quantize(w)
            out[name], out[f"{prefix}.scale"] = q["weight"], q["scale"]
        elif FP8.search(name):
            q = get_format("fp8_block_scale").quantize(w)
            out[name], out[f"{prefix}.scale"] = q["weight"], q["scale"]
        elif name.endswith("tid2eid"):
            out[name] = w.to(torch.int32)
        else:
            out[name] = w.to(torch.float32 if F32.search(name) else torch.bfloat16)
    return out


def write_checkpoint(out: Path, layout: str = "deepseek", variant: str = "tiny") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    weights = model_weights(variant)
    if layout == "transformers":
        _save_transformers(out, weights, deepseek_config(variant))
    else:
        tensors = deepseek_tensors(weights)
        shards = {1: {}, 2: {}}
        for name, t in tensors.items():  # scales of layer 1 in the other shard than their weight
            second = name.startswith(("layers.2.", "layers.3.", "mtp.", "head"))
            flip = name.startswith("layers.1.") and name.endswith(".scale")
            shards[2 if second != flip else 1][name] = t.contiguous()
        index = {}
        for i, shard in shards.items():
            fname = f"model-0000{i}-of-00002.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, fname))
        _json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": index})
        _json(out / "config.json", deepseek_config(variant))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, out / f)
    return out


def _save_transformers(out: Path, weights: dict[str, torch.Tensor], config: dict) -> None:
    """Load the BF16 weights in DeepSeek's names through transformers' own conversion mapping
    (which proves ``to_deepseek`` its inverse: nothing missing, nothing left over but the MTP
    layer), then ``save_pretrained``."""
    import tempfile

    from transformers import DeepseekV4ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        main = {k: (v if k.endswith("tid2eid") else v.to(torch.bfloat16)).contiguous()
                for k, v in weights.items() if not k.startswith("mtp.")}  # fmt: skip
        save_file(main, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        cfg = {k: v for k, v in config.items() if k not in ("quantization_config",
                                                                      "expert_dtype")}  # fmt: skip
        _json(Path(tmp) / "config.json", {**cfg, "num_nextn_predict_layers": 1})
        model, info = DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=torch.bfloat16, output_loading_info=True
        )
    left = {k: v for k, v in info.items() if v and k != "mismatched_keys"}
    if left or info.get("mismatched_keys"):
        raise RuntimeError(f"to_deepseek is not transformers' inverse here: {info}")
    model.save_pretrained(out)


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layout", choices=("deepseek", "transformers"), default="deepseek")
    p.add_argument("--dims", choices=tuple(VARIANTS), default="tiny")
    args = p.parse_args()
    print(write_checkpoint(args.out, args.layout, args.dims))


if __name__ == "__main__":
    main()
