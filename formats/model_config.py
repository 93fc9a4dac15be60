"""DeepSeek-V3-family ``config.json``, parsed once into a validated, documented object."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .errors import HetquantError

__all__ = ["ModelConfig", "load_json"]


def load_json(path: Path) -> Any:
    """Read a JSON file; a missing or invalid file is a HetquantError naming it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HetquantError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HetquantError(f"{path}: invalid JSON ({e}); fix or re-download the file") from None


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a DeepSeek-V3 HF config that conversion and loading need."""

    # model
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    # mla
    num_attention_heads: int
    q_lora_rank: int | None  # None: q_proj instead of q_a/q_b (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # mlp / moe
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    # source quantization (DeepSeek's FP8 block size; None when the source is not FP8)
    weight_block_size: tuple[int, int] | None
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], origin: str = "config.json") -> ModelConfig:
        values: dict[str, Any] = {}
        optional = {
            "q_lora_rank",
            "weight_block_size",
            "raw",
            "num_nextn_predict_layers",
            "moe_layer_freq",
        }
        missing = [f.name for f in fields(cls) if f.name not in optional and f.name not in raw]
        if missing:
            raise HetquantError(
                f"{origin}: missing field(s) {', '.join(missing)}; is this a DeepSeek-V3-family config?"
            )
        for f in fields(cls):
            if f.name not in optional:
                values[f.name] = _int(raw, f.name, origin)
        values["q_lora_rank"] = (
            None if raw.get("q_lora_rank") is None else _int(raw, "q_lora_rank", origin)
        )
        values["num_nextn_predict_layers"] = int(raw.get("num_nextn_predict_layers", 0) or 0)
        values["moe_layer_freq"] = int(raw.get("moe_layer_freq", 1) or 1)
        qc = raw.get("quantization_config") or {}
        block = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
        values["weight_block_size"] = tuple(block) if block else None
        return cls(raw=raw, **values)

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        if not path.exists():
            raise HetquantError(
                f"{path}: no config.json; SOURCE must be a Hugging Face model directory"
            )
        raw = load_json(path)
        if not isinstance(raw, dict):
            raise HetquantError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(path))

    # derived facts -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mtp_layer_ids(self) -> range:
        """Layer ids of the multi-token-prediction modules (after the main layers)."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    @property
    def total_layers(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def _int(raw: dict[str, Any], key: str, origin: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HetquantError(f"{origin}: field {key} must be a non-negative integer, got {value!r}")
    return value
