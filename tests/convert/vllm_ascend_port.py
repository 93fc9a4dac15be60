"""How vllm-ascend 0.23.0.post1 (on vLLM 0.23.0) would load a DeepSeek-V3 / Kimi K2 artifact with
``--quantization ascend``, ported offline: no NPU, no vLLM, headers only. Our code, written from
their source (paths relative to each package):

1. the description: ``quant_model_description.json`` read by name (``modelslim_config.py:67``),
   ``shared_head`` and ``weight_packed`` keys aliased (``:860-934``);
2. the modules vLLM's ``DeepseekV2ForCausalLM`` builds (``models/deepseek_v2.py``: MLA with
   ``fused_qkv_a_proj`` :928-973, dense MLP / shared experts ``gate_up_proj`` + ``down_proj``
   :216-231, ``FusedMoE`` experts :326-338, router ``GateLinear`` without quant config and an F32
   ``e_score_correction_bias`` :274-284), and each one's quant type (``get_linear_quant_type``
   :348-382 with the ``deepseek_v3`` / ``kimi_k2`` packed mappings :102-120, ``FLOAT`` =
   unquantized via ``is_layer_skipped_ascend`` :681-708; a missing key is a KeyError);
3. the scheme registered for (type, layer kind) (``methods/registry.py``; NotImplementedError
   otherwise) and the parameters it declares: W8A8_DYNAMIC linear and MoE
   (``methods/w8a8_dynamic.py:48-73, 155-212``), W4A8_DYNAMIC MoE, msModelSlim path
   (``methods/w4a8.py:347-485``), W4A16 MoE (``methods/w4a16.py:180-246``), with the MoE
   parameters' loader kinds from ``method_adapters.py:216-247``;
4. every checkpoint tensor through vLLM's name mapping (``deepseek_v2.py:1344-1560``: stacked
   ``gate_up_proj`` / ``fused_qkv_a_proj``, ``make_expert_params_mapping``, else the parameter of
   that name — absent: KeyError) and weight loader at each TP rank: column / merged / row /
   replicated linears (``layers/linear.py:362-380, 530-565, 689-860, 1493-1528``: narrow, then
   ``assert param.shape == loaded.shape``) and ``FusedMoE.weight_loader``
   (``layers/fused_moe/layer.py:592-803, 849-1140``) — in ``vllm_ascend_load``.

Stricter than vLLM, on purpose: a checkpoint tensor must be covered exactly by the TP ranks'
slices (vLLM's ``narrow`` would silently take a prefix of a larger tensor), every declared
parameter must be filled (quantized models skip vLLM's check; an unfilled one holds
``torch.empty`` garbage) unless the scheme synthesizes it, and a dtype that vLLM's ``copy_``
would round is reported. Not ported: the MTP draft model (vllm-ascend renames its model type
to ``deepseek_mtp``, whose packed mapping lacks ``fused_qkv_a_proj``; reference §I), expert
parallelism, kernels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Module", "Param", "model_params", "plain_params", "read_description"]

_MLA_MOE = {"gate_up_proj": ["gate_proj", "up_proj"],
            "experts": ["experts.0.gate_proj", "experts.0.up_proj", "experts.0.down_proj"],
            "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}  # fmt: skip
PACKED = {"deepseek_v3": _MLA_MOE, "kimi_k2": _MLA_MOE}
# (type, layer kind) pairs registered by vllm-ascend 0.23.0.post1 among those our artifacts could
# name (reference §E); W4A16 has no linear scheme (methods/w4a16.py:111 registers "moe" only)
SCHEMES = {("W8A8_DYNAMIC", "linear"), ("W8A8_DYNAMIC", "moe"), ("W4A8_DYNAMIC", "linear"),
           ("W4A8_DYNAMIC", "moe"), ("W4A16", "moe"), ("W8A8", "linear")}  # fmt: skip


@dataclass(frozen=True)
class Param:
    """A declared parameter: dtype, shape and how vLLM loads it (``kind``)."""

    dtype: str
    shape: tuple[int, ...]
    kind: str  # linear: weight | channel; moe: weight | channel | group | single
    synthesized: bool = False  # filled by the scheme itself, never from the checkpoint


@dataclass(frozen=True)
class Module:
    prefix: str
    layer: str  # linear | moe
    tp_kind: str  # column | row | replicated (merged linears: column/replicated + shards)
    in_size: int
    shards: tuple[tuple[str, int], ...]  # (checkpoint module suffix, out size); one if unfused


def read_description(root: Path) -> dict:
    """The description as ``AscendModelSlimConfig`` holds it after its key adaptations."""
    desc = json.loads((root / "quant_model_description.json").read_text())
    extra = {}
    for k, v in desc.items():
        if "shared_head" in k:
            extra[k.replace(".shared_head.", ".")] = v
        if "weight_packed" in k:
            extra[k.replace("weight_packed", "weight")] = v
    return {**desc, **extra}


def _modules(cfg: dict) -> list[Module]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    out = []
    for i in range(cfg["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if q_lora:
            out += [Module(f"{a}.fused_qkv_a_proj", "linear", "replicated", h,
                           (("q_a_proj", q_lora), ("kv_a_proj_with_mqa", kv_lora + rope))),
                    Module(f"{a}.q_b_proj", "linear", "column", q_lora,
                           (("q_b_proj", heads * (nope + rope)),))]  # fmt: skip
        else:
            out += [Module(f"{a}.q_proj", "linear", "column", h, (("q_proj", heads * (nope + rope)),)),
                    Module(f"{a}.kv_a_proj_with_mqa", "linear", "replicated", h,
                           (("kv_a_proj_with_mqa", kv_lora + rope),))]  # fmt: skip
        out += [Module(f"{a}.kv_b_proj", "linear", "column", kv_lora,
                       (("kv_b_proj", heads * (nope + v)),)),
                Module(f"{a}.o_proj", "linear", "row", heads * v, (("o_proj", h),))]  # fmt: skip
        moe = cfg.get("n_routed_experts") and i >= cfg["first_k_dense_replace"]
        moe = moe and i % cfg.get("moe_layer_freq", 1) == 0
        if moe:
            inter = cfg["moe_intermediate_size"]
            out.append(Module(f"{m}.experts", "moe", "column", h, (("experts", inter),)))
            m, inter = f"{m}.shared_experts", inter * cfg["n_shared_experts"]
        else:
            inter = cfg["intermediate_size"]
        out += [Module(f"{m}.gate_up_proj", "linear", "column", h,
                       (("gate_proj", inter), ("up_proj", inter))),
                Module(f"{m}.down_proj", "linear", "row", inter, (("down_proj", h),))]  # fmt: skip
    return out


def _quant_type(desc: dict, prefix: str, packed: dict) -> str:
    """``get_linear_quant_type``; a missing key raises KeyError as there."""
    proj = prefix.split(".")[-1]
    if proj not in packed:
        return desc[prefix + ".weight"]
    types = {desc[prefix.replace(proj, shard) + ".weight"] for shard in packed[proj]}
    if len(types) > 1:
        raise ValueError(f"Not all shards of {prefix} are quantized with same quant type: {types}")
    return types.pop()


def _linear_params(qtype: str, out: int, inp: int, dtype: str) -> dict[str, Param]:
    if qtype == "FLOAT":
        return {"weight": Param(dtype, (out, inp), "weight")}
    if qtype == "W8A8_DYNAMIC":
        return {"weight": Param("I8", (out, inp), "weight"),
                "weight_scale": Param(dtype, (out, 1), "channel"),
                "weight_offset": Param(dtype, (out, 1), "channel")}  # fmt: skip
    raise NotImplementedError(f"{qtype} linear: not ported (no artifact of ours uses it)")


def _moe_params(qtype: str, e: int, i: int, h: int, tp: int, desc: dict, dtype: str) -> dict:
    """Parameters of one FusedMoE (``i``: intermediate size per partition)."""
    if qtype == "FLOAT":
        return {"w13_weight": Param(dtype, (e, 2 * i, h), "weight"),
                "w2_weight": Param(dtype, (e, h, i), "weight")}  # fmt: skip
    if qtype in ("W8A8_DYNAMIC", "W4A8_DYNAMIC"):
        w4 = qtype == "W4A8_DYNAMIC"
        group = desc.get("group_size", 256) if w4 else 0  # w4a8.py:351-353: absent = 256
        packed = w4 and desc.get("version", "0") == "1.0.0"
        scale, kind = ("F32" if w4 else dtype), ("group" if group > 0 else "channel")
        p = {"w13_weight": Param("I8", (e, i if packed else 2 * i, h), "weight"),
             "w2_weight": Param("I8", (e, h // 2 if packed else h, i), "weight")}  # fmt: skip
        for w, rows, cols in (("w13", 2 * i, h), ("w2", h, i)):
            p[f"{w}_weight_scale"] = Param(scale, (e, rows, 1), kind)
            p[f"{w}_weight_offset"] = Param(scale, (e, rows, 1), kind)
            if group:
                p[f"{w}_weight_scale_second"] = Param("F32", (e, rows, cols // group), "group")
                p[f"{w}_weight_offset_second"] = Param("F32", (e, rows, cols // group), "group")
        if packed:
            if tp > 16:
                raise ValueError("The current weight does not support moe part tp>16.")
            p["w13_scale_bias"] = Param("F32", (e, 2 * i, 1), "group")
            p["w2_scale_bias"] = Param("F32", (e, h, 16 // tp), "group")
        return p
    if qtype == "W4A16":
        g = desc.get("group_size", 32)
        assert i % 8 == 0 and h % 8 == 0 and i % g == 0 and h % g == 0, (i, h, g)
        return {"w13_weight_packed": Param("I32", (e, 2 * i, h // 8), "weight"),
                "w2_weight_packed": Param("I32", (e, h, i // 8), "weight"),
                "w13_weight_scale": Param(dtype, (e, 2 * i, h // g), "group"),
                "w2_weight_scale": Param(dtype, (e, h, i // g), "group"),
                "w13_weight_shape": Param("I32", (e, 2), "single"),
                "w2_weight_shape": Param("I32", (e, 2), "single"),
                "w13_weight_offset": Param(dtype, (e, 2 * i, h // g), "group", True),
                "w2_weight_offset": Param(dtype, (e, h, i // g), "group", True)}  # fmt: skip
    raise NotImplementedError(f"{qtype} moe: not ported (no artifact of ours uses it)")


def model_params(cfg: dict, desc: dict, tp: int) -> tuple[dict, dict]:
    """(vLLM parameter name → (Module, Param), module prefix → its quant type)."""
    packed, dtype = PACKED[cfg["model_type"]], {"bfloat16": "BF16"}[cfg["torch_dtype"]]
    params, types = {}, {}
    for mod in _modules(cfg):
        qtype = _quant_type(desc, mod.prefix, packed)
        if qtype != "FLOAT" and (qtype, mod.layer) not in SCHEMES:
            raise NotImplementedError(f"quant_type={qtype} for layer_type={mod.layer}")
        if mod.prefix.endswith("kv_b_proj") and qtype != "FLOAT":  # attention/mla_v1.py:908
            raise AssertionError(f"{mod.prefix}: vllm-ascend MLA needs kv_b_proj unquantized")
        types[mod.prefix] = qtype
        parts = 1 if mod.tp_kind == "replicated" else tp
        out = sum(s for _, s in mod.shards)
        if mod.layer == "moe":
            p = _moe_params(qtype, cfg["n_routed_experts"], out // tp, mod.in_size, tp, desc, dtype)
        else:
            inp = mod.in_size // tp if mod.tp_kind == "row" else mod.in_size
            p = _linear_params(qtype, out // parts if mod.tp_kind != "row" else out, inp, dtype)
        params.update({f"{mod.prefix}.{k}": (mod, v) for k, v in p.items()})
    return params, types


def plain_params(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parameters loaded whole by ``default_weight_loader`` (shape must be equal)."""
    h, e, dt = cfg["hidden_size"], cfg.get("n_routed_experts"), "BF16"
    out = {"model.embed_tokens.weight": (dt, (cfg["vocab_size"], h)), "model.norm.weight": (dt, (h,)),
           "lm_head.weight": (dt, (cfg["vocab_size"], h))}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = out[f"{p}.post_attention_layernorm.weight"] = (
            dt,
            (h,),
        )
        out[f"{p}.self_attn.kv_a_layernorm.weight"] = (dt, (cfg["kv_lora_rank"],))
        if cfg.get("q_lora_rank"):
            out[f"{p}.self_attn.q_a_layernorm.weight"] = (dt, (cfg["q_lora_rank"],))
        if e and i >= cfg["first_k_dense_replace"]:
            out[f"{p}.mlp.gate.weight"] = (dt, (e, h))
            out[f"{p}.mlp.gate.e_score_correction_bias"] = ("F32", (e,))
    return out
