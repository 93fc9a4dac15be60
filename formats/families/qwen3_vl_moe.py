"""The Qwen3-VL-MoE family (Qwen3-VL-235B-A22B, Qwen3-VL-30B-A3B, their -FP8 repos): the Qwen3-MoE
text decoder under ``model.language_model.``, plus the vision tower (``vlm.py`` says how).

Facts (transformers 5.24 ``models/qwen3_vl_moe/``; vLLM 0.32 ``models/qwen3_vl_moe.py``):

- config.json: ``model_type`` ``qwen3_vl_moe``, ``Qwen3VLMoeForConditionalGeneration``;
  ``text_config`` (``qwen3_vl_moe_text``, ``configuration_qwen3_vl_moe.py:33-117``) holds
  Qwen3-MoE's fields; ``num_experts`` may be saved as ``num_local_experts`` (its
  ``attribute_map``, :63-65); the rope is ``rope_parameters`` / ``rope_scaling`` with
  ``mrope_section`` and ``rope_theta`` (older configs: ``rope_theta`` beside it).
- Text names: ``model.language_model.{embed_tokens, layers.L.*, norm}``, ``lm_head`` at the top
  (``modeling_qwen3_vl_moe.py`` ``Qwen3VLMoeModel`` / ``Qwen3VLMoeForConditionalGeneration``).
  Decoder layers are Qwen3-MoE's: GQA with q/k norms, softmax top-k router — renormalised
  always (``Qwen3VLMoeTextTopKRouter.forward``, :166: no ``norm_topk_prob`` switch, so the text
  config read here says ``norm_topk_prob: true``).
- Experts: BF16 checkpoints fuse them, ``mlp.experts.gate_up_proj [E, H, 2I]`` /
  ``down_proj [E, I, H]``, transposed against nn.Linear (``conversion_mapping.py:1450-1461``;
  vLLM ``is_fused_checkpoint_transposed=True``, :76): ``formats/fused_experts.py``. The -FP8 repos
  store them per expert with DeepSeek's 128×128 block scales (``weight_scale_inv``), the
  ``modules_to_not_convert`` list naming what stays BF16 (transformers
  ``quantizers_utils.py:26-37``: a name matches from the start at a module boundary, as a regex
  with that boundary, or as a suffix).
- mrope on text-only input: the three position rows (t, h, w) are the same index
  (``Qwen3VLMoeTextRotaryEmbedding.forward``, :824 expands one row to three), so the interleaved
  sections pick one frequency set at one position: the rotation is Qwen3-MoE's 1-D rope of
  ``rope_theta`` with ``head_dim`` channels (``runtime/forward/qwen3_moe.py``).
- Vision (``Qwen3VLMoeVisionModel``): ``model.visual.patch_embed.proj`` (Conv3d
  [hidden, in_channels, temporal_patch, patch, patch] + bias), ``pos_embed`` [num_position_embeddings,
  hidden], ``blocks.N.{norm1, norm2}`` (LayerNorm weight + bias), ``blocks.N.attn.{qkv, proj}``,
  ``blocks.N.mlp.{linear_fc1, linear_fc2}`` (weight + bias), ``merger`` (LayerNorm over
  ``hidden``, then ``linear_fc1`` [m, m], ``linear_fc2`` [out_hidden, m], m = hidden ·
  spatial_merge²) and one ``deepstack_merger_list.K`` per ``deepstack_visual_indexes`` entry (its
  LayerNorm over m, after the shuffle).
- Vision linears engines read quantized: msModelSlim 26.1's ``lab_practice/qwen3_vl_moe/
  qwen3_vl_moe_w8a8.yaml`` (verified for Qwen3-VL-235B-A22B / 30B-A3B on vllm-ascend) quantizes
  every ``nn.Linear`` (``processor/quant/linear.py:121-132``, fnmatch patterns) but the experts
  (W8A8_DYNAMIC), ``*linear_fc2``, ``*merger*``, ``*deepstack_merger_list*`` and ``*mlp.gate``
  in W8A8: in the vision tower the blocks' ``attn.qkv``, ``attn.proj`` and ``mlp.linear_fc1``
  (``patch_embed.proj`` is a Conv3d). Those are ``quantizable`` here (``vlm.py``).
"""

from __future__ import annotations

from typing import Any

from ..errors import HetquantError
from .fields import ConfigFields
from .shapes import K, shape
from .vlm import VisionPart, VlmSpec, register_vlm
from .vlm import vision_linear as _linear
from .vlm import vision_norm as _norm

__all__ = ["FAMILY", "SPEC", "decoder_raw"]


def decoder_raw(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """``text_config`` as a Qwen3-MoE config.json (module docstring): ``num_experts``, the rope
    theta and no mrope block (text-only positions), ``norm_topk_prob`` true, the wrapper's
    ``tie_word_embeddings``."""
    text = dict(raw["text_config"])
    if "num_experts" not in text and "num_local_experts" in text:
        text["num_experts"] = text["num_local_experts"]
    rope = text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {}
    if not isinstance(rope, dict):
        raise HetquantError(f"{origin}: text_config rope parameters are not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HetquantError(
            f"{origin}: text_config rope_type {kind!r}; Qwen3-VL-MoE's is 'default' (mrope)"
        )
    if "rope_theta" in rope:
        text["rope_theta"] = rope["rope_theta"]
    text["norm_topk_prob"] = True
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    text["model_type"] = "qwen3_moe"
    return text


def _vision_counts(f: ConfigFields) -> tuple[int, int]:
    return f.integer("depth"), len(f.integers("deepstack_visual_indexes", ()))


_h = K("hidden_size")
_m = _h * K("spatial_merge_size") * K("spatial_merge_size")  # a merger's width
_out = K("out_hidden_size")
V, B, D = "model.visual", "model.visual.blocks.{b}", "model.visual.deepstack_merger_list.{d}"
Q = True  # quantizable (module docstring: msModelSlim's Qwen3-VL-MoE W8A8 recipe)
VISION_PARTS: tuple[VisionPart, ...] = (
    VisionPart(f"{V}.patch_embed.proj.weight", "linear", shape(
        _h, K("in_channels"), K("temporal_patch_size"), K("patch_size"), K("patch_size"))),
    VisionPart(f"{V}.patch_embed.proj.bias", "bias", shape(_h)),
    VisionPart(f"{V}.pos_embed.weight", "embedding", shape(K("num_position_embeddings"), _h)),
    *_norm(f"{B}.norm1", _h),
    *_linear(f"{B}.attn.qkv", 3 * _h, _h, Q),
    *_linear(f"{B}.attn.proj", _h, _h, Q),
    *_norm(f"{B}.norm2", _h),
    *_linear(f"{B}.mlp.linear_fc1", K("intermediate_size"), _h, Q),
    *_linear(f"{B}.mlp.linear_fc2", _h, K("intermediate_size")),
    *_norm(f"{V}.merger.norm", _h),
    *_linear(f"{V}.merger.linear_fc1", _m, _m),
    *_linear(f"{V}.merger.linear_fc2", _out, _m),
    *_norm(f"{D}.norm", _m),
    *_linear(f"{D}.linear_fc1", _m, _m),
    *_linear(f"{D}.linear_fc2", _out, _m),
)  # fmt: skip

VISION_FIELDS = ("hidden_size", "intermediate_size", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size",
                 "num_position_embeddings")  # fmt: skip
SPEC = VlmSpec(
    text="qwen3_moe",
    renames=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    vision=VISION_PARTS,
    vision_fields=VISION_FIELDS,
    decoder_raw=decoder_raw,
    vision_counts=_vision_counts,
    text_types=("qwen3_vl_moe_text",),
)

FAMILY = register_vlm(
    "qwen3_vl_moe", SPEC, ("qwen3_vl_moe",), ("Qwen3VLMoeForConditionalGeneration",)
)
