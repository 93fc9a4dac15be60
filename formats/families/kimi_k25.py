"""The Kimi K2.5 family: Kimi K2's DeepSeek-V3 text decoder under ``language_model.``, plus the
MoonViT vision tower and its projector (``vlm.py`` says how a VLM family is made).

Facts (transformers 5.24 ``models/kimi_k25/``, ``conversion_mapping.py:658-710``; vLLM 0.32
``models/kimi_k25.py:311-319``):

- config.json: ``model_type`` ``kimi_k25``; ``text_config`` a DeepSeek-V3 (K2) config, its
  ``model_type`` ``kimi_k2`` on the Hub (``configuration_kimi_k25.py:80-83`` maps it to
  ``deepseek_v3``) — both read. The released vision config uses the remote code's schema
  (``vt_hidden_size``, ``vt_intermediate_size``, ``vt_num_hidden_layers``,
  ``init_pos_emb_height`` / ``_width``; vLLM's note at ``transformers_utils/config.py:103``: "hub
  remote code uses old schema", the names as in vLLM's ``configs/kimi_k3.py:18-43``);
  transformers' own names (``hidden_size``, ``pos_emb_height``, ...) are read too.
- Checkpoint names (the sources of transformers' renames): ``language_model.model.{embed_tokens,
  layers.L.*, norm}``, ``language_model.lm_head``; ``vision_tower.patch_embed.proj`` (Conv2d
  [hidden, 3, patch, patch] + bias), ``vision_tower.patch_embed.pos_emb.weight`` [pos_h, pos_w,
  hidden], ``vision_tower.encoder.blocks.N.{norm0, norm1}`` (LayerNorm), ``.wqkv`` [3·hidden,
  hidden] (+ bias), ``.wo``, ``.mlp.fc0`` [intermediate, hidden], ``.mlp.fc1`` (each + bias),
  ``vision_tower.encoder.final_layernorm``; ``mm_projector.pre_norm`` (LayerNorm over hidden),
  ``mm_projector.proj.0`` [m, m] and ``proj.2`` [text hidden, m] (+ bias), m = hidden · kh · kw
  (``merge_kernel_size``; ``modeling_kimi_k25.py:546-556``).
- Experts: as K2 Thinking, compressed-tensors pack-quantized INT4, group 32, the rest BF16
  (ROCm ATOM's K2.5 recipe; reference/model_families.md §1): read by the DeepSeek-V3 family's
  sources, repacked losslessly where a recipe's format allows. Where the source's
  ``quantization_config`` lives (top level or ``text_config``) is not verified here: both are
  read, and the artifact's config.json carries none of the source's.
- Vision linears engines read quantized: msModelSlim 26.1's ``lab_practice/kimi_k2_5/
  kimi_w4a8.yaml`` (for Kimi-K2.5) visits the vision tower and the projector
  (``model/kimi_k2_5/model_adapter.py:309-333``) and writes W8A8_DYNAMIC for every ``nn.Linear``
  matching ``*mlp*`` but the experts (fnmatch, ``processor/quant/linear.py:121-132``): in the
  vision tower the blocks' ``mlp.fc0`` and ``mlp.fc1``; ``wqkv``, ``wo`` and the projector stay
  float (its K2.6 MXFP8 recipe adds ``wqkv`` / ``wo``, a format hetquant does not write). Those
  two are ``quantizable`` here (``vlm.py``).
"""

from __future__ import annotations

from typing import Any

from ..errors import HetquantError
from .fields import ConfigFields
from .shapes import K, shape
from .vlm import VisionPart, VlmSpec, register_vlm
from .vlm import vision_linear as _linear
from .vlm import vision_norm as _norm

__all__ = ["FAMILY", "SPEC", "vision_raw"]

# the remote code's vision names → transformers' (the names the shapes read)
_ALIASES = (("vt_hidden_size", "hidden_size"), ("vt_intermediate_size", "intermediate_size"),
            ("vt_num_hidden_layers", "num_hidden_layers"), ("init_pos_emb_height", "pos_emb_height"),
            ("init_pos_emb_width", "pos_emb_width"))  # fmt: skip
VISION_FIELDS = ("hidden_size", "intermediate_size", "patch_size", "pos_emb_height",
                 "pos_emb_width", "merge_area", "text_hidden_size")  # fmt: skip


def decoder_raw(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """``text_config`` as it is: a DeepSeek-V3 (K2) config.json."""
    return dict(raw["text_config"])


def vision_raw(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """The vision config under transformers' names, with the merge area (kh · kw) and the text
    decoder's hidden size (the projector's output) the shapes read."""
    vision = dict(raw["vision_config"])
    for old, new in _ALIASES:
        if new not in vision and old in vision:
            vision[new] = vision[old]
    kernel = vision.get("merge_kernel_size", [2, 2])
    if not (isinstance(kernel, list | tuple) and len(kernel) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in kernel)):  # fmt: skip
        raise HetquantError(
            f"{origin}: vision_config merge_kernel_size {kernel!r}: expected [kh, kw]"
        )
    vision["merge_area"] = kernel[0] * kernel[1]
    vision["text_hidden_size"] = ConfigFields(raw["text_config"], origin).integer("hidden_size")
    return vision


def _vision_counts(f: ConfigFields) -> tuple[int, int]:
    return f.integer("num_hidden_layers"), 0


_h = K("hidden_size")
_m = _h * K("merge_area")  # the projector's width: merged patches' channels
V, B = "vision_tower", "vision_tower.encoder.blocks.{b}"
Q = True  # quantizable (module docstring: msModelSlim's Kimi K2.5 W4A8 recipe)
VISION_PARTS: tuple[VisionPart, ...] = (
    VisionPart(f"{V}.patch_embed.proj.weight", "linear",
               shape(_h, 3, K("patch_size"), K("patch_size"))),
    VisionPart(f"{V}.patch_embed.proj.bias", "bias", shape(_h)),
    VisionPart(f"{V}.patch_embed.pos_emb.weight", "embedding",
               shape(K("pos_emb_height"), K("pos_emb_width"), _h)),
    *_norm(f"{B}.norm0", _h),
    *_linear(f"{B}.wqkv", 3 * _h, _h),
    *_linear(f"{B}.wo", _h, _h),
    *_norm(f"{B}.norm1", _h),
    *_linear(f"{B}.mlp.fc0", K("intermediate_size"), _h, Q),
    *_linear(f"{B}.mlp.fc1", _h, K("intermediate_size"), Q),
    *_norm(f"{V}.encoder.final_layernorm", _h),
    *_norm("mm_projector.pre_norm", _h),
    *_linear("mm_projector.proj.0", _m, _m),
    *_linear("mm_projector.proj.2", K("text_hidden_size"), _m),
)  # fmt: skip

SPEC = VlmSpec(
    text="deepseek_v3",
    renames=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    vision=VISION_PARTS,
    vision_fields=VISION_FIELDS,
    decoder_raw=decoder_raw,
    vision_counts=_vision_counts,
    text_types=("kimi_k2", "deepseek_v3"),
    vision_raw=vision_raw,
)

FAMILY = register_vlm(
    "kimi_k25",
    SPEC,
    ("kimi_k25",),
    ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"),
)
