"""The Ascend recipes that keep the routed experts 4-bit, for vllm-ascend's MoE schemes.

Both are ``ascend-w8a8`` (W8A8_DYNAMIC attention, dense MLPs and shared experts; kv_b_proj,
router, embeddings, lm_head and norms at source precision) with other routed experts; the
description (``recipes/metadata.py``) lists every root tensor with its type and the one
``group_size`` the expert scheme reads.

| recipe | routed experts | MTP layer's routed experts | description ``group_size`` |
|---|---|---|---|
| ascend-w4a8 | ``w4a8_dynamic``: msModelSlim's W4A8_DYNAMIC, version 1.0.0 packed layout, per-channel int4 + per-token int8 activations | ``w8a8_dynamic``, as msModelSlim's ``deepseek_w4a8_per_channel`` practice | 0 (per channel) |
| ascend-w4a16 | ``ct_pack_quantized``: the LLM-Compressor pack-quantized layout vllm-ascend's W4A16 MoE scheme reads (``weight_shape`` int32), group 32 (default) or 128 | ``ct_pack_quantized`` | the group |

vllm-ascend 0.23.0.post1 registers W4A8_DYNAMIC for linears and MoE but W4A16 for MoE only
(``quantization/methods/w4a16.py:111``), which is why only the routed experts are 4-bit here.

A source whose routed experts are already INT4 (Kimi K2 Thinking: compressed-tensors
pack-quantized, group 32, symmetric, BF16 scales):

- ``ascend-w4a16`` writes the SAME codes and scales (``formats/linear_repack.py``): its layout is
  the source's own, with ``weight_shape`` as int32. ``--group-size 128`` cannot hold group-32
  scales and is refused unless ``--requantize``.
- ``ascend-w4a8`` cannot hold them: msModelSlim's W4A8_DYNAMIC is per channel, one F32 scale per
  row, so 32-wide groups of scales do not fit. (vllm-ascend also reads a per-group W4A8 layout,
  ``weight_scale_second`` [n, k/g], but rounds every group scale to FP16 at load — exact for
  BF16 scales only within FP16's range — and no tool writes it at group 32; hetquant does not
  write it.) Re-quantizing is refused unless ``--requantize``, the policy of every recipe.

Calibration (``--calib-data``), as the hybrid's: the routed experts are AWQ-searched with their
own format as the quantizer (``calib/quantizer.py``: ``w4a8_dynamic`` per row, clips per row;
``ct_pack_quantized`` per group of the recipe's ``group_size``), column scales folded into the
norm (router compensated) and into up_proj for down_proj, as awq-w4a16 does; the W8A8 linears
are not searched but scored with ``w8a8_dynamic``'s weights and scaled where a searched mapping
shares their input (the shared experts); the MTP layer stays round-to-nearest. Without
``--calib-data`` the manifest has no calibration entry, as before these recipes calibrated. A
K2 Thinking source's INT4 experts, kept as they are by ``ascend-w4a16``, refuse calibration
(``convert/engine/calibration.py``).

``--keep-dense-down`` keeps the dense layers' MLP down_proj in BF16 (``FLOAT``), as on
``ascend-w8a8`` (``recipes/quantized.py``).
"""

from __future__ import annotations

from hetquant.formats import FORMATS

from . import serving
from .base import register_recipe
from .quantized import _KEEP_DENSE_DOWN, _KEEPS, _MTP, KEEP, QUANTIZED_VISION, RuleRecipe

__all__: list[str] = []

_W8A8 = FORMATS["w8a8_dynamic"]
_W8A8_RULES = {"attention": _W8A8, "absorbed": KEEP, "dense": _W8A8, "shared": _W8A8,
               QUANTIZED_VISION: _W8A8, **_KEEPS}  # fmt: skip
# --calib-data searches the routed experts (module docstring); RTN manifests as before
_CALIBRATED = {"calibrates": True, "records_rtn": False, "search": frozenset({"routed"})}

register_recipe(
    RuleRecipe(
        "ascend-w4a8",
        "vllm-ascend W4A8_DYNAMIC: routed experts int4 per-channel (msModelSlim 1.0.0 packed layout) with int8 activations, the rest as ascend-w8a8; AWQ-calibrated experts with --calib-data",
        rules={**_W8A8_RULES, "routed": FORMATS["w4a8_dynamic"], "mtp_routed": _W8A8},
        choices={**_MTP, **_KEEP_DENSE_DOWN},
        **_CALIBRATED,
        tags=("ascend", "w4a8", "int4", "int8"),
        serving=serving.VLLM_ASCEND,
    )
)
register_recipe(
    RuleRecipe(
        "ascend-w4a16",
        "vllm-ascend W4A16 MoE: routed experts int4 weight-only (pack-quantized, group 32 or 128; an INT4 group-32 source kept as is), the rest as ascend-w8a8; AWQ-calibrated experts with --calib-data",
        rules={**_W8A8_RULES, "routed": FORMATS["ct_pack_quantized"]},
        choices={**_MTP, "group_size": (32, 128), **_KEEP_DENSE_DOWN},
        # vllm-ascend's W4A16 MoE scheme declares weight_shape int32 (methods/w4a16.py:237-238)
        fixed={"ct_pack_quantized": (("shape_dtype", "I32"),)},
        **_CALIBRATED,
        tags=("ascend", "w4a16", "int4"),
        serving=serving.VLLM_ASCEND,
    )
)
