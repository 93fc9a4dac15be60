"""Model families: one module per family, each registered by name in ``FAMILIES``
(``base.py`` says what a family declares and how config.json picks one)."""

from . import (  # noqa: F401  (registration)
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    kimi_k25,
    qwen3_moe,
    qwen3_vl_moe,
)
from .base import (
    FAMILIES,
    ModelConfig,
    ModelFamily,
    expected_tensors,
    family_for_config,
    get_family,
    load_config,
    load_json,
    parse_config,
    register_family,
    unregister_family,
)
from .bounds import check_index_holds, expected_count
from .mappings import AwqMappings, Balance
from .roles import SCALE_SUFFIX, GatedMlp, Located, Role, TensorRole

__all__ = [
    "FAMILIES",
    "SCALE_SUFFIX",
    "AwqMappings",
    "Balance",
    "GatedMlp",
    "Located",
    "ModelConfig",
    "ModelFamily",
    "Role",
    "TensorRole",
    "check_index_holds",
    "expected_count",
    "expected_tensors",
    "family_for_config",
    "get_family",
    "load_config",
    "load_json",
    "parse_config",
    "register_family",
    "unregister_family",
]
