"""Fixtures for the whole suite; helpers live in ``support.py`` (a unique module name, so
``tests/calib/conftest.py`` cannot shadow them)."""

from support import (  # noqa: F401  (fixtures, registered by being imported here)
    artifact_copy,
    cli,
    hetquant_proc,
    tiny_artifact,
    tiny_artifact_1mb,
    tiny_hybrid,
    tiny_qwen3,
    tiny_qwen3_vl,
    tiny_ro,
    tiny_ro_hashes,
    tiny_src,
    tiny_v4,
    tiny_v4_vllm,
)
