"""What a model family declares, and the registry that maps config.json to a family.

A *family* (DeepSeek-V3 first; Kimi K2, Qwen3-MoE, ... next) is one module in this package that
holds, as data, everything convert, calib and runtime need to know about a model architecture:

- its **config type**, a subclass of :class:`ModelConfig`: config.json parsed once and validated.
  Generic code reads only the attributes declared on ``ModelConfig``; the family's own fields
  (``kv_lora_rank``, ...) are for the family module and its reference forward;
- its **role table**, a tuple of :class:`Role` rows: every tensor's name pattern, expected shape,
  precision group, kind, tensor-parallel split and expert kind. ``ModelFamily.expected_tensors``
  expands it for a config; the runtime's shard rules read its ``tp`` column; the reference forward
  asks for names by role (``family.tensor("embed")``);
- its **AWQ mappings** (``mappings.AwqMappings``): which linears share an input, what absorbs
  their scale.

This module holds :class:`ModelConfig` and the registry; :class:`ModelFamily` (names by role,
expected tensors, locating a stored module) is ``family.py``, the table's rows ``roles.py`` and
their shapes ``shapes.py``.

Conventional role names, so that code shared by families (recipes, the reference forward) finds
the same concept under the same name: ``embed``, ``final_norm``, ``lm_head``, ``attn_norm``,
``ffn_norm``, ``router``, ``router_bias``, ``{dense,shared,expert}_{gate,up,down}``. Role names
and precision groups are recorded in manifests (source dtypes by role, the precision table):
renaming one changes every artifact's ``hetquant.json``.

Choosing a family (``family_for_config``): config.json's ``model_type`` names it; a model type no
family lists falls back to ``architectures`` (Kimi K2 ships ``model_type: kimi_k2`` with
``DeepseekV3ForCausalLM``). A config.json without ``model_type`` is refused (issue #17 item 10):
every published checkpoint of a supported family has one, and guessing the family from field
names would accept any config that happens to share them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ..errors import HetquantError
from ..json_io import load_json
from .family import ModelFamily, bound
from .roles import EXPERT_KINDS, KINDS, TP_SPLITS, TensorRole
from .shapes import Shape

__all__ = [
    "FAMILIES",
    "ModelConfig",
    "ModelFamily",
    "expected_tensors",
    "family_for_config",
    "get_family",
    "load_config",
    "load_json",
    "parse_config",
    "register_family",
    "unregister_family",
]


class ModelConfig:
    """Base of every family's config type: a frozen dataclass built from config.json.

    Generic attributes (what convert, calib and runtime may read): ``raw`` (the dict),
    ``hidden_size``, ``vocab_size``, ``num_hidden_layers`` (main decoder layers),
    ``num_attention_heads``, ``weight_block_size`` (the FP8 source block, None when the source is
    not FP8), ``num_experts`` (routed experts per MoE layer), ``num_mtp_layers``,
    ``is_moe_layer(layer)``, ``layer_scopes(layer)`` and ``without_mtp(raw)``; derived here:
    ``family``, ``total_layers``, ``mtp_layer_ids``, ``moe_layers``, ``quantization_config``.

    Every field a family reads goes through ``fields.ConfigFields`` (type and range checked, a
    HetquantError naming the field otherwise): config.json is untrusted input.
    """

    family_name: ClassVar[str] = ""  # set by register_family
    raw: dict[str, Any]
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    weight_block_size: tuple[int, int] | None
    num_experts: int  # a field or a property of the subclass
    num_mtp_layers: int

    @classmethod
    def parse(cls, raw: dict[str, Any], origin: str) -> ModelConfig:
        """Validate ``raw`` (read from ``origin``) into this config type."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, raw: dict[str, Any], origin: str = "config.json") -> ModelConfig:
        """``raw`` parsed by this config type; on ``ModelConfig`` itself, by its family's."""
        return parse_config(raw, origin) if cls is ModelConfig else cls.parse(raw, origin)

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        """``load_config(path)``."""
        return load_config(path)

    def is_moe_layer(self, layer: int) -> bool:
        raise NotImplementedError

    @property
    def tp_head_counts(self) -> tuple[int, ...]:
        """Head counts tensor parallelism must divide (GQA families add their KV heads)."""
        return (self.num_attention_heads,)

    def layer_scopes(self, layer: int) -> frozenset[str]:
        """The role scopes decoder layer ``layer`` holds (``mtp`` is added for MTP layers)."""
        raise NotImplementedError

    @classmethod
    def without_mtp(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """config.json ``raw`` (a copy) saying the model has no MTP layers."""
        raise NotImplementedError

    @property
    def decoder_raw(self) -> dict[str, Any]:
        """The text decoder's config dict the reference forward reads: ``raw``; a VLM's text
        config (``vlm.py``)."""
        return self.raw

    @property
    def quantization_config(self) -> dict[str, Any]:
        """config.json's ``quantization_config`` ({} when absent); an object whose
        ``quant_method`` / ``scale_fmt`` are strings (``fields.source_quantization``, at parse);
        a VLM's is its text decoder's (``decoder_raw``: the top-level one, else text_config's)."""
        return self.decoder_raw.get("quantization_config") or {}

    @property
    def family(self) -> ModelFamily:
        """The family, bound to this config where its MTP layers have a prefix of their own."""
        return bound(get_family(self.family_name), self.num_hidden_layers)

    @property
    def total_layers(self) -> int:
        return self.num_hidden_layers + self.num_mtp_layers

    @property
    def mtp_layer_ids(self) -> range:
        """Layer ids of the multi-token-prediction modules (after the main layers)."""
        return range(self.num_hidden_layers, self.total_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers: main-model ones, then MTP ones."""
        return tuple(layer for layer in range(self.total_layers) if self.is_moe_layer(layer))


# -- the registry -----------------------------------------------------------------------------

FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` (checks its table's columns; binds its config type to it)."""
    if family.name in FAMILIES:
        raise RuntimeError(f"model family {family.name!r} registered twice")
    if "family_name" in vars(family.config_type):
        raise RuntimeError(f"{family.config_type.__name__} already belongs to a family")
    names = [r.name for r in family.roles]
    if len(set(names)) != len(names):
        raise RuntimeError(f"family {family.name}: role names repeat")
    for r in family.roles:
        if r.kind not in KINDS or r.tp not in TP_SPLITS or r.expert not in EXPERT_KINDS:
            raise RuntimeError(f"family {family.name}, role {r.name}: kind/tp/expert not known")
        if not isinstance(r.shape, Shape):  # data, so that a plan holding roles pickles
            raise RuntimeError(f"family {family.name}, role {r.name}: shape is not a shapes.Shape")
    family.config_type.family_name = family.name
    FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove family ``name`` and unbind its config type (tests that define a family of their own)."""
    family = FAMILIES.pop(name)
    del family.config_type.family_name


def get_family(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise HetquantError(f"unknown model family {name!r}; known: {_known()}") from None


def _known() -> str:
    return ", ".join(t for f in FAMILIES.values() for t in f.model_types) or "none"


def family_for_config(raw: Mapping[str, Any], origin: str = "config.json") -> ModelFamily:
    """The family of config.json ``raw``: by ``model_type``, else by ``architectures``."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HetquantError(
            f"{origin}: no model_type; hetquant converts the model types {_known()} — add the "
            "checkpoint's model_type to config.json"
        )
    for family in FAMILIES.values():
        if model_type in family.model_types and (family.accepts is None or family.accepts(raw)):
            return family
        why = dict(family.refused_types).get(model_type)
        if why is not None:
            raise HetquantError(f"{origin}: model_type {model_type!r}: {why}")
    archs = raw.get("architectures")
    archs = archs if isinstance(archs, list) else []
    for family in FAMILIES.values():
        if set(archs) & set(family.architectures):
            return family
    text = raw.get("text_config")
    if isinstance(text, Mapping):  # a vision-language wrapper: name its text decoder
        raise HetquantError(
            f"{origin}: model_type {model_type!r} is a vision-language model whose text decoder "
            f"(text_config model_type {text.get('model_type')!r}) hetquant has no family for; it "
            f"converts the model types {_known()} (a VLM over a known text family is one module: "
            "formats/families/vlm.py)"
        )
    raise HetquantError(
        f"{origin}: model_type {model_type!r} (architectures {archs}) is no model family hetquant "
        f"knows; it converts the model types {_known()}"
    )


def parse_config(raw: Mapping[str, Any], origin: str = "config.json") -> ModelConfig:
    """config.json ``raw`` parsed by its family's config type."""
    return family_for_config(raw, origin).parse_config(dict(raw), origin)


def load_config(path: Path) -> ModelConfig:
    """Read and parse ``path`` (a model directory's config.json)."""
    if not path.exists():
        raise HetquantError(
            f"{path}: no config.json; SOURCE must be a Hugging Face model directory"
        )
    raw = load_json(path)
    if not isinstance(raw, dict):
        raise HetquantError(f"{path}: expected a JSON object")
    return parse_config(raw, str(path))


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorRole]:
    """``cfg.family.expected_tensors(cfg)``."""
    return cfg.family.expected_tensors(cfg)
