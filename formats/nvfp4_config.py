"""ModelOpt's config files for an NVFP4 artifact (``formats/nvfp4.py``): ``hf_quant_config.json``
and the ``quantization_config`` of config.json, as vLLM's ModelOpt support reads them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import Any

from .errors import HetquantError
from .nvfp4_codes import BLOCK

__all__ = ["hf_quant_config"]


@functools.cache
def _hetquant_version() -> str:
    """The installed distribution's version, "0+unknown" from a source tree. Looked up on first
    use, not at import: ``importlib.metadata`` and its scan of ``sys.path`` cost every command
    ~12 ms of start-up."""
    import importlib.metadata

    try:
        return importlib.metadata.version("hetquant")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def hf_quant_config(
    exclude_modules: Iterable[str],
    *,
    with_input_scale: bool = False,
    kv_cache_quant_algo: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """ModelOpt's ``hf_quant_config.json`` and the ``quantization_config`` for config.json.

    Args:
        exclude_modules: module names or glob patterns kept unquantized (``lm_head``, ...);
            written sorted and de-duplicated so artifacts are byte-identical.
        with_input_scale: the format variant's flag. True → ``quant_algo: NVFP4`` (W4A4, as
            ``nvidia/DeepSeek-R1-FP4``; needs ``input_scale``). False → ``W4A16_NVFP4``,
            ModelOpt's weight-only name (``convert_hf_config.py``), so that a W4A4 engine
            refuses the artifact instead of running with a missing ``input_scale``.
        kv_cache_quant_algo: ``None`` (KV cache unquantized) or e.g. ``"FP8"``.

    Returns:
        ``(hf_quant_config, quantization_config)``. The first has the keys of fp4.md §2.1
        (``producer``; ``quantization``: ``quant_algo``, ``kv_cache_quant_algo``,
        ``group_size``, ``exclude_modules``). The second is the same dict plus
        ``"quant_method": "modelopt"``: vLLM's ModelOpt config reads this nested
        ``quantization`` form from config.json as well as from hf_quant_config.json.
    """
    if isinstance(exclude_modules, str):
        raise HetquantError("hf_quant_config: exclude_modules must be a list of names, not a str")
    quantization = {
        "quant_algo": "NVFP4" if with_input_scale else "W4A16_NVFP4",
        "kv_cache_quant_algo": kv_cache_quant_algo,
        "group_size": BLOCK,
        "exclude_modules": sorted(set(exclude_modules)),
    }
    hf = {
        "producer": {"name": "hetquant", "version": _hetquant_version()},
        "quantization": quantization,
    }
    return hf, {"quant_method": "modelopt", **copy.deepcopy(hf)}
