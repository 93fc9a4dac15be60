"""Vision-language wrappers: a VLM family is its text family under a prefix, plus a vision tower.

A VLM checkpoint (Qwen3-VL-MoE, Kimi K2.5) holds a text decoder that is a known MoE family, with
its tensor names moved under a prefix, and a vision tower + projector the text path never reads.
:func:`register_vlm` makes such a family from a :class:`VlmSpec` — one module per VLM:

- **config**: a subclass of the text family's config type, parsed from ``text_config`` as the
  text family parses its own config.json (``VlmSpec.decoder_raw`` maps the VLM's keys onto the
  text family's, e.g. a ``rope_parameters`` block onto ``rope_theta``), with the top-level
  ``quantization_config`` (the source's FP8 scheme). ``raw`` stays the whole config.json (the
  artifact's config.json is the VLM's); ``decoder_raw`` is the text config the reference forward
  reads;
- **role table**: the text family's rows, global names renamed by ``VlmSpec.renames`` (text
  prefix → stored prefix: ``model.`` → ``model.language_model.``), the layer prefix likewise; the
  same groups, kinds, splits and AWQ mappings, so every recipe quantizes the text decoder exactly
  as it quantizes the text family, and its fused-expert layout;
- **vision**: :class:`VisionPart` rows expanded over the vision config's blocks (``{b}``) and
  deepstack mergers (``{d}``), scope ``vision``. Every recipe keeps them at source precision by
  default (an FP8 source's vision linears are dequantized exactly to BF16, as every kept weight).
  A part marked ``quantizable`` is a vision linear that msModelSlim's recipe for the model
  quantizes and vllm-ascend reads quantized (the family module cites which); it is not ``kept``
  but of role class ``vision`` (``convert/recipes/role_class.py``), which the Ascend recipes'
  ``--quantize-vision`` writes in ``w8a8_dynamic`` (:data:`VISION_READ`).
  :func:`check_vision_kept` refuses a plan that would write any other vision tensor quantized,
  or a quantizable one in a format no engine reads, naming the module, before anything is
  written.

Why ``w8a8_dynamic`` and what reads it: vllm-ascend runs vLLM's own model classes, which hand
the quantization config to the vision linears (vLLM 0.32 ``qwen3_vl.py:419-435, 470-485``:
``Qwen3_VisionMLP`` / ``Qwen3_VisionBlock``; ``kimi_k25.py:350-368``, the config dropped there for
compressed-tensors only), and its ModelSlim config resolves each linear's scheme from
``quant_model_description.json`` by its name (``modelslim_config.py:701-740`` at vllm-ascend
``182b75e``, ``apply_vllm_mapper`` :599-620 renaming ``model.visual.`` keys as vLLM names the
layers) — W8A8_DYNAMIC is a registered linear scheme with a bias (``methods/w8a8_dynamic.py:51,
130``). msModelSlim writes W8A8 static there (per-tensor activation ranges calibrated on
images); hetquant's calibration runs the text path only, so the same int8 per-channel weights
go with per-token dynamic activations. No other engine hetquant writes for is known to read a
quantized vision tower, and the reference forward (``runtime/forward/``) is text-only.

Processor files (``preprocessor_config.json``, ``video_preprocessor_config.json``,
``chat_template.*``) travel with every small non-weight file (``convert/aux_files.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import HetquantError
from .base import ModelConfig, ModelFamily, get_family, register_family
from .fields import ConfigFields
from .roles import GLOBAL, GLOBAL_LAST, Located, Role, TensorRole
from .shapes import Dim, Shape, shape

__all__ = [
    "SOURCE_PRECISION",
    "VISION",
    "VISION_READ",
    "VisionPart",
    "VlmFamily",
    "VlmSpec",
    "check_vision_kept",
    "register_vlm",
    "vision_linear",
    "vision_norm",
]

VISION = "vision"  # the scope and precision group of vision-tower tensors
SOURCE_PRECISION = frozenset({"copy", "bf16"})  # targets that keep a tensor at source precision
VISION_READ = frozenset({"w8a8_dynamic"})  # a quantizable vision linear's formats engines read
_INDEX = {"{b}": "blocks", "{d}": "mergers"}  # pattern placeholder → VisionConfig count


@dataclass(frozen=True)
class VisionConfig:
    """A vision config's integer fields (validated), and its block and deepstack-merger counts."""

    fields: Mapping[str, int]
    blocks: int
    mergers: int

    def __getitem__(self, key: str) -> int:
        return self.fields[key]


@dataclass(frozen=True)
class VisionPart:
    """One vision tensor: its full name (``{b}``: a block, ``{d}``: a deepstack merger), kind
    (``roles.KINDS``), shape of the :class:`VisionConfig`, and whether engines read it quantized
    (``quantizable``: module docstring)."""

    pattern: str
    kind: str
    shape: Shape  # of the vision config
    quantizable: bool = False

    @cached_property
    def role(self) -> Role:
        name = VISION + ":" + re.sub(r"\.\{[bd]\}", "", self.pattern)
        return Role(name, self.pattern, VISION, VISION, self.kind, "replicate", None,
                    Shape(self.shape.dims, of="vision"), kept=not self.quantizable)  # fmt: skip

    @cached_property
    def regex(self) -> re.Pattern[str]:
        module = self.pattern.rpartition(".")[0]
        return re.compile(r"(\d+)".join(map(re.escape, re.split(r"\{[bd]\}", module))))


def vision_linear(
    prefix: str, out: Dim, inp: Dim, quantizable: bool = False
) -> tuple[VisionPart, ...]:
    """A vision linear's weight [out, inp] and bias [out] (``quantizable``: engines read it
    quantized, :class:`VisionPart`)."""
    return (VisionPart(f"{prefix}.weight", "linear", shape(out, inp), quantizable),
            VisionPart(f"{prefix}.bias", "bias", shape(out)))  # fmt: skip


def vision_norm(prefix: str, dim: Dim) -> tuple[VisionPart, ...]:
    """A vision LayerNorm's weight and bias [dim]."""
    return (VisionPart(f"{prefix}.weight", "norm", shape(dim)),
            VisionPart(f"{prefix}.bias", "norm", shape(dim)))  # fmt: skip


@dataclass(frozen=True)
class VlmSpec:
    """What a VLM family module declares (module docstring)."""

    text: str  # the text family's name
    renames: tuple[tuple[str, str], ...]  # text-name prefix → stored prefix (first match wins)
    vision: tuple[VisionPart, ...]
    vision_fields: tuple[str, ...]  # the vision config's integer fields the shapes read
    decoder_raw: Callable[[dict[str, Any], str], dict[str, Any]]  # config.json → text config
    vision_counts: Callable[[ConfigFields], tuple[int, int]]  # (blocks, deepstack mergers)
    text_types: tuple[str, ...] = ()  # the text_config model_types it reads (absent: any)
    # config.json → the vision config the shapes read (None: ``vision_key``'s object as it is)
    vision_raw: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    text_key: str = "text_config"
    vision_key: str = "vision_config"

    def rename(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name


@dataclass(frozen=True)
class VlmFamily(ModelFamily):
    """A family made by :func:`register_vlm`: its text family's table, renamed, plus vision."""

    spec: VlmSpec | None = None

    @property
    def text_family(self) -> ModelFamily:
        return get_family(self.spec.text)  # type: ignore[union-attr]

    def expected_tensors(self, cfg: ModelConfig) -> dict[str, TensorRole]:
        """The text decoder's tensors, then the vision tower's (blocks, then mergers)."""
        out = super().expected_tensors(cfg)
        vision: VisionConfig = cfg.vision  # type: ignore[attr-defined]
        for part in self.spec.vision:  # type: ignore[union-attr]
            role, shape = part.role, part.role.shape(cfg)
            ids = next((getattr(vision, n) for k, n in _INDEX.items() if k in part.pattern), None)
            for i in range(1) if ids is None else range(ids):
                name = part.pattern.replace("{b}", str(i)).replace("{d}", str(i))
                out[name] = TensorRole(role, None, None, shape)
        return out

    def locate(self, module: str) -> Located | None:
        for part in self.spec.vision:  # type: ignore[union-attr]
            if part.regex.fullmatch(module):
                return Located(part.role, None, None)
        return super().locate(module)


def register_vlm(
    name: str,
    spec: VlmSpec,
    model_types: tuple[str, ...],
    architectures: tuple[str, ...],
) -> VlmFamily:
    """Register the VLM family ``name`` over ``spec.text`` (module docstring)."""
    text = get_family(spec.text)
    roles = tuple(
        dataclasses.replace(r, pattern=spec.rename(r.pattern))
        if r.scope in (GLOBAL, GLOBAL_LAST) else r
        for r in text.roles
    )  # fmt: skip
    family = VlmFamily(
        name, _config_type(name, text.config_type, spec), roles, text.awq,
        model_types=model_types, architectures=architectures,
        layer_prefix=spec.rename(text.layer_prefix), attention_group=text.attention_group,
        forward_refusal=text.forward_refusal, fused_experts=text.fused_experts, spec=spec,
    )  # fmt: skip
    register_family(family)
    return family


def _config_type(name: str, text_type: type[ModelConfig], spec: VlmSpec) -> type[ModelConfig]:
    """A subclass of ``text_type`` parsed from a VLM config.json (module docstring)."""

    @dataclass(frozen=True)
    class VlmConfig(text_type):  # type: ignore[valid-type, misc]
        text_raw: dict[str, Any] = field(default_factory=dict)
        vision: VisionConfig | None = None

        @classmethod
        def parse(cls, raw: dict[str, Any], origin: str = "config.json") -> ModelConfig:
            f = ConfigFields(raw, origin)
            f.require((spec.text_key, spec.vision_key), f"is this a {name} config?")
            for key in (spec.text_key, spec.vision_key):
                if not isinstance(raw[key], dict):
                    raise HetquantError(f"{origin}: {key} is not an object")
            kind = raw[spec.text_key].get("model_type")
            if spec.text_types and kind is not None and kind not in spec.text_types:
                raise HetquantError(
                    f"{origin}: text_config model_type {kind!r} is not {name}'s text decoder "
                    f"({', '.join(spec.text_types)}), so no text family hetquant knows reads it; "
                    "use the config.json published with the checkpoint"
                )
            text = spec.decoder_raw(raw, origin)
            qc = raw.get("quantization_config")
            text = {**text, "quantization_config": qc} if qc is not None else text
            cfg = super().parse(text, f"{origin}: {spec.text_key}")
            return dataclasses.replace(cfg, raw=raw, text_raw=text,
                                       vision=_vision(raw, origin, spec))  # fmt: skip

        @property
        def decoder_raw(self) -> dict[str, Any]:
            return self.text_raw

        @classmethod
        def without_mtp(cls, raw: dict[str, Any]) -> dict[str, Any]:
            return {**raw, spec.text_key: text_type.without_mtp(dict(raw[spec.text_key]))}

    VlmConfig.__name__ = VlmConfig.__qualname__ = f"{text_type.__name__}Vlm"
    return VlmConfig


def _vision(raw: dict[str, Any], origin: str, spec: VlmSpec) -> VisionConfig:
    vision = raw[spec.vision_key] if spec.vision_raw is None else spec.vision_raw(raw, origin)
    f = ConfigFields(vision, f"{origin}: {spec.vision_key}")
    f.require(spec.vision_fields, "is the vision config complete?")
    blocks, mergers = spec.vision_counts(f)
    return VisionConfig({k: f.integer(k) for k in spec.vision_fields}, blocks, mergers)


def check_vision_kept(assigned: Iterable[tuple[str, TensorRole, str]], recipe: str) -> None:
    """Refuse a plan whose recipe would quantize a vision tensor (``assigned``: tensor name, role,
    target format; ``copy`` and ``bf16`` are source precision) other than a quantizable linear in
    a format engines read (:data:`VISION_READ`) — module docstring."""
    for tensor, role, fmt in assigned:
        if role.role.scope != VISION or fmt in SOURCE_PRECISION:
            continue
        if role.role.kept:
            raise HetquantError(
                f"{tensor.rpartition('.')[0]}: recipe {recipe} would quantize this vision module "
                f"to {fmt}, but no engine hetquant targets is known to read it quantized "
                "(msModelSlim keeps it in float); keep it at source precision (nothing was written)"
            )
        if fmt not in VISION_READ:
            raise HetquantError(
                f"{tensor.rpartition('.')[0]}: recipe {recipe} would quantize this vision module "
                f"to {fmt}, but no engine hetquant targets is known to read a vision linear in "
                f"{fmt} (vllm-ascend reads {', '.join(sorted(VISION_READ))}: the Ascend recipes' "
                "--quantize-vision); drop --quantize-vision (nothing was written)"
            )
