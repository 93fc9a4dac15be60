"""On-disk formats: one module per format, each registered by name in ``FORMATS``."""

from . import bf16, fp8_block, int4_cpu  # noqa: F401  (registration)
from .base import FORMATS, TensorMeta, WeightFormat, get_format, register
from .errors import HetquantError

__all__ = ["FORMATS", "HetquantError", "TensorMeta", "WeightFormat", "get_format", "register"]
