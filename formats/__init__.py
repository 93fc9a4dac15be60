"""On-disk formats: one module per format, each registered by name in ``FORMATS``."""

from . import awq_w4a16, bf16, ct_pack_quantized, fp8_block, int4_cpu  # noqa: F401  (registration)
from .base import FORMATS, TensorMeta, WeightFormat, get_format, register
from .errors import HetquantError

__all__ = ["FORMATS", "HetquantError", "TensorMeta", "WeightFormat", "get_format", "register"]
