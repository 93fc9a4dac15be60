"""``quant_model_description.json``, the tensor → quant type table that vllm-ascend and MindIE
read beside an Ascend artifact (msModelSlim's ascendV1 saver writes it; reference/
ascend_formats.md): the entries of one stored module and the file's top-level keys.

The Ascend description type of each format that has one is data here (``_QUANT_TYPE_OF_FORMAT``);
the formats themselves live in ``w8a8_npu.py``, ``w4a8_npu.py`` and ``ct_pack_quantized.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import get_format
from .errors import HetquantError

__all__ = [
    "DESCRIPTION_VERSION",
    "QUANT_TYPE_FLOAT",
    "QUANT_TYPE_W8A8",
    "QUANT_TYPE_W8A8_DYNAMIC",
    "description_entries",
    "description_header",
]

QUANT_TYPE_W8A8_DYNAMIC = "W8A8_DYNAMIC"
QUANT_TYPE_W8A8 = "W8A8"
QUANT_TYPE_FLOAT = "FLOAT"
DESCRIPTION_VERSION = "1.0.0"  # msModelSlim ascendV1 saver
_QUANT_TYPE_OF_FORMAT = {
    "w8a8_dynamic": QUANT_TYPE_W8A8_DYNAMIC,
    "w8a8": QUANT_TYPE_W8A8,
    "bf16": QUANT_TYPE_FLOAT,
    "w4a8_dynamic": "W4A8_DYNAMIC",  # formats/w4a8_npu.py
    "ct_pack_quantized": "W4A16",  # vllm-ascend's W4A16 MoE scheme reads this layout
}
_ANY_SHAPE = (1, 1)  # stored-tensor names of these formats do not depend on the shape


def description_entries(
    module_prefix: str, fmt_name: str, keys: Iterable[str] | None = None
) -> dict[str, str]:
    """``quant_model_description.json`` entries for one module stored in ``fmt_name``.

    Every stored tensor is listed (msModelSlim does so; vllm-ascend reads ``<prefix>.weight``,
    with ``weight_packed`` standing for ``weight``); ``keys``: the module's stored keys (default:
    the format's, for formats whose keys do not depend on the shape). Float tensors that are not
    a module weight (a layer bias, ``e_score_correction_bias``) are listed by the caller as
    ``{name: QUANT_TYPE_FLOAT}``.
    """
    try:
        quant_type = _QUANT_TYPE_OF_FORMAT[fmt_name]
    except KeyError:
        raise HetquantError(
            f"{module_prefix}: format {fmt_name!r} has no Ascend description type; "
            f"known: {', '.join(sorted(_QUANT_TYPE_OF_FORMAT))}"
        ) from None
    names = get_format(fmt_name).stored(_ANY_SHAPE) if keys is None else keys
    return {f"{module_prefix}.{local}": quant_type for local in names}


def description_header(model_quant_type: str = QUANT_TYPE_W8A8_DYNAMIC) -> dict[str, object]:
    """Top-level keys of ``quant_model_description.json``, in the order msModelSlim's ascendV1
    saver writes them after the per-tensor entries (``post_run``,
    ``core/quant_service/modelslim_v1/save/ascendv1.py:209-227``): ``version``,
    ``model_quant_type``, ``metadata`` (``{}`` without QuaRot), ``group_size`` (0 =
    per-channel), ``optional`` (``{}`` by default). Callers append it after the entries.

    DeepSeek's msModelSlim script forces ``W8A8_DYNAMIC`` for its mixed model (MindIE needs it).
    """
    known = (QUANT_TYPE_W8A8_DYNAMIC, QUANT_TYPE_W8A8, QUANT_TYPE_FLOAT)
    if model_quant_type not in known:
        raise HetquantError(f"model_quant_type {model_quant_type!r} is not one of {known}")
    return {
        "version": DESCRIPTION_VERSION,
        "model_quant_type": model_quant_type,
        "metadata": {},
        "group_size": 0,
        "optional": {},
    }
