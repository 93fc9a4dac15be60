"""On-disk formats: one module per format, each registered by name in ``FORMATS``."""

from . import (  # noqa: F401  (registration)
    awq_w4a16,
    bf16,
    ct_pack_quantized,
    fp4_cpu,
    fp4_e2m1,
    fp8_block,
    fp8_block_scale,
    int4_cpu,
    int4_cpu_group,
    nvfp4,
    nvfp4_ascend,
    w4a8_npu,
    w8a8_npu,
)
from .base import FORMATS, TensorMeta, WeightFormat, get_format, register
from .errors import HetquantError
from .expert_layer import EXPERT_FORMATS, ExpertLayerFormat, get_expert_format

__all__ = [
    "EXPERT_FORMATS",
    "FORMATS",
    "ExpertLayerFormat",
    "HetquantError",
    "TensorMeta",
    "WeightFormat",
    "get_expert_format",
    "get_format",
    "register",
]
