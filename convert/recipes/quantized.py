"""The quantizing recipes, each a rule table: role class → format.

Role classes (``convert/recipes/role_class.py``, from the attributes of a tensor's role in its
family's table): ``attention``, ``absorbed``, ``dense``, ``shared``, ``routed``, ``router``,
``embedding``, ``norm``, ``mtp_extra``, ``kept`` and ``vision``. ``KEEP`` keeps a tensor at
source precision (``recipes.keep``): quantized source weights are dequantized to BF16 (exactly),
others copied. The MTP layer's ordinary tensors follow the same rules as any MoE layer (``--mtp
keep``, the default) or are left out (``--mtp drop``, and config.json then says
``num_nextn_predict_layers: 0``).

``keep_dense_down`` (``--keep-dense-down``; ascend-hybrid, ascend-w8a8, ascend-w4a8,
ascend-w4a16): every dense-layer MLP's ``down_proj`` kept at source precision (``dense`` class,
``mlp == "down"``), the rest of the dense MLP as the rules say; vllm-ascend serves such a linear
unquantized (``FLOAT``), as it does kv_b.

``quantize_vision`` (``--quantize-vision``, every rule recipe): the ``vision`` class follows the
``quantized_vision`` rule instead of KEEP — ``w8a8_dynamic`` for the Ascend recipes, whose
engine (vllm-ascend, through ``quant_model_description.json``) reads it; the others' rule is the
format they give a linear, which the plan refuses naming the module (``check_vision_kept``): no
engine reads a vision linear in it. Off by default: msModelSlim quantizes these linears, but the
vision tower is a small part of the model (Qwen3-VL-235B: 0.58 B of 235.7 B parameters, 0.28 B in
those linears) and its
accuracy under int8 activations is not measured here.

``int4_cpu*``: the source's lossless CPU repack when it has one (Kimi K2 Thinking's INT4 group-32
experts), else ``int4_cpu_experts`` (per-channel) or, with ``cpu_group_size`` (``--cpu-group-size
32|64|128``), ``int4_cpu_group_experts`` (BF16 scale per group: 4.5 / 4.25 / 4.125 bits per
weight against ~4.0).

Calibration (``--calib-data``, recipes with ``calibrates``): every linear a rule quantizes is
calibrated with its target format as the quantizer; the role classes in ``search`` (None: all)
get their AWQ scales and clips searched, the others are folded where a searched mapping shares
their input and scored with their own quantizer (``calib/layer.py``).

| recipe | attention | absorbed | dense, shared | routed | router, embeddings, norms, MTP extras |
|---|---|---|---|---|---|
| ascend-hybrid | w8a8_dynamic | KEEP | w8a8_dynamic | int4_cpu* in ``cpu_experts/`` | KEEP |
| ascend-w8a8 | w8a8_dynamic | KEEP | w8a8_dynamic | w8a8_dynamic | KEEP |
| awq-w4a16 | awq_w4a16 | awq_w4a16 | awq_w4a16 | awq_w4a16 | KEEP |
| fp4 | KEEP | KEEP | nvfp4_ascend / nvfp4 | nvfp4_ascend / nvfp4 | KEEP |
| ct-w4a16 | KEEP | KEEP | KEEP | ct_pack_quantized | KEEP |

vllm-ascend requires ``kv_b_proj`` unquantized (``mla_v1.py``: "We currently do not support quant
kv_b_proj"); the router is not an nn.Linear in DeepSeek's modeling code and stays FLOAT in
msModelSlim's output (reference/ascend_formats.md §2.3).

ct-w4a16 quantizes only what vllm-ascend can serve in W4A16: it registers that scheme for MoE
layers alone (``quantization/methods/w4a16.py:111``, ``@register_scheme("W4A16", "moe")``) and
raises NotImplementedError for a W4A16 linear (``compressed_tensors_config.py:333-338``), so every
other linear stays at source precision and is listed in ``ignore`` (Kimi-K2-Thinking's layout).
It is symmetric because that MoE method builds all-zero offsets and never loads a zero point
(``w4a16.py:239-244``); the AWQ calibration then searches with the symmetric quantizer.

A low-bit source re-quantized to another low-bit format is refused unless ``--requantize``
(``convert/recipes/requantize.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from hetquant.formats import FORMATS, ExpertLayerFormat, HetquantError
from hetquant.formats.families import TensorRole
from hetquant.formats.families.vlm import VISION
from hetquant.formats.int4_cpu_group import GROUP_SIZES as CPU_GROUP_SIZES
from hetquant.formats.linear_repack import LINEAR_REPACKS

from . import serving
from .base import DROP_TARGET, Recipe, Target, Written, keep, register_recipe
from .choices import CPU_INT4, FP4, KEEP, Choice, Params, Rule
from .requantize import LOW_BITS, check_repack, check_requantize, density
from .role_class import dense_down, role_class

__all__ = [
    "CPU_INT4",
    "FP4",
    "KEEP",
    "LOW_BITS",
    "QUANTIZED_VISION",
    "Choice",
    "Params",
    "Rule",
    "RuleRecipe",
    "density",
    "role_class",
]

QUANTIZED_VISION = "quantized_vision"  # the rule for class ``vision`` under --quantize-vision

CPU_EXPERTS = "cpu_experts"


@dataclass(frozen=True)
class RuleRecipe(Recipe):
    """A recipe given by ``rules`` (class → format object or :class:`Choice`), option choices
    and parameters it fixes for a format (``fixed``, by format name)."""

    rules: dict[str, Rule] = field(default_factory=dict)
    fixed: dict[str, Params] = field(default_factory=dict)  # format name → params
    search: frozenset[str] | None = None  # role classes --calib-data searches (None: all)

    def assign(self, role: TensorRole, source_fmt: str) -> Target:
        if role.mtp and self.option("mtp") == "drop":
            return DROP_TARGET
        rule = self.rule(role)
        chosen = rule.resolve(self, role, source_fmt) if isinstance(rule, Choice) else (rule, ())
        if chosen is None:
            return keep(source_fmt)
        target = self._target(*chosen, role)
        check_requantize(self, role, source_fmt, target)
        return target

    def rule(self, role: TensorRole) -> Rule:
        """The format (or choice) the rules give a tensor of ``role``: its class's, the MTP
        layer's own (``mtp_<class>``), KEEP for a dense MLP's down_proj with
        ``keep_dense_down``."""
        cls = role_class(role)
        if role.mtp and f"mtp_{cls}" in self.rules:  # the MTP layer's own rule for this class
            cls = f"mtp_{cls}"
        if dense_down(cls, role) and self._keeps_dense_down():
            return KEEP
        if cls == VISION and self._option_on("quantize_vision"):
            return self.rules[QUANTIZED_VISION]
        return self.rules[cls]

    def _option_on(self, key: str) -> bool:
        return key in self.choices and bool(self.option(key))

    def _keeps_dense_down(self) -> bool:
        return self._option_on("keep_dense_down")

    def check_model(self, roles: list[TensorRole]) -> None:
        """``keep_dense_down`` on a model without a dense MLP down_proj (every layer MoE, e.g.
        Qwen3-MoE), ``quantize_vision`` on one without a vision linear engines read quantized
        (a text model): each would change nothing, and is refused."""
        if self._keeps_dense_down() and not any(dense_down(role_class(r), r) for r in roles):
            raise HetquantError(
                f"recipe {self.name}: --keep-dense-down keeps the dense layers' MLP down_proj in "
                "BF16, and this model has none (every layer is MoE); it would change nothing: "
                "drop it"
            )
        if self._option_on("quantize_vision") and not any(role_class(r) == VISION for r in roles):
            raise HetquantError(
                f"recipe {self.name}: --quantize-vision quantizes a vision-language model's "
                "vision linears, and this model has none; it would change nothing: drop it"
            )

    def calibration(self, role: TensorRole) -> str | None:
        """``search`` / ``quantized`` / None for a tensor of ``role`` (``Recipe.calibration``);
        None for a vision linear: calibration runs the text path only."""
        cls = role_class(role)
        if not self.calibrates or role.role.kind != "linear" or self.rule(role) is KEEP:
            return None
        if cls == VISION:
            return None
        return "search" if self.search is None or cls in self.search else "quantized"

    def cpu_group_size(self) -> int | None:
        """``--cpu-group-size`` where the recipe takes it (None: per-channel)."""
        return self.option("cpu_group_size") if "cpu_group_size" in self.choices else None

    def refine(self, target: Target, source_params: Params, source_fmt: str = "") -> Target:
        """A lossless repack target takes the source variant's parameters it shares (the
        compressed-tensors group size becomes the CPU group format's). A linear target with a
        repack from the source's format (``formats/linear_repack.py``) keeps the recipe's
        parameters; where those do not hold the source's codes, re-quantizing is refused unless
        ``requantize`` was asked for."""
        if (source_fmt, target.name) in LINEAR_REPACKS:
            check_repack(self, target, source_params, source_fmt)
            return target
        if not target.stacks_experts or not source_params or target.params:
            return target
        names = {f.name for f in dataclasses.fields(target.fmt)}  # type: ignore[arg-type]
        params = tuple((k, v) for k, v in source_params if k in names)
        return target.with_params(params) if params else target

    def _target(self, fmt: Written, params: Params, role: TensorRole) -> Target:
        if isinstance(fmt, ExpertLayerFormat):
            file = f"{CPU_EXPERTS}/layer_{role.layer:03d}.safetensors"
            return Target.writing(fmt, params, part=CPU_EXPERTS, file=file)
        params += _TARGET_PARAMS[fmt.name](self, role) if fmt.name in _TARGET_PARAMS else ()
        params += self.fixed.get(fmt.name, ())
        return Target.writing(fmt, params)


# a target format's parameters, from the recipe's options and the tensor's role
_TARGET_PARAMS: dict[str, Callable[[RuleRecipe, TensorRole], Params]] = {
    "awq_w4a16": lambda r, role: (("group_size", r.option("group_size")),),
    # msModelSlim sums scale_bias in 16 chunks for row-parallel linears (down), 1 for others
    "w4a8_dynamic": lambda r, role: (("bias_chunks", 16 if role.role.tp == "row" else 1),),
    "ct_pack_quantized": lambda r, role: (("group_size", r.option("group_size")),),
}


_W8A8, _AWQ = FORMATS["w8a8_dynamic"], FORMATS["awq_w4a16"]
_REQUANTIZE = {"requantize": (False, True)}
# every rule recipe takes --quantize-vision; its ``quantized_vision`` rule says what it would
# write, and the plan refuses a format no engine reads (formats/families/vlm.py)
_MTP = {"mtp": ("keep", "drop"), **_REQUANTIZE, "quantize_vision": (False, True)}
# the dense MLPs' down_proj kept in BF16 (FLOAT in the Ascend description): their per-token int8
# activations are nearly all of the W8A8 part's KL on the trained tiny model (0.00586 → 0.00199,
# the calibrated hybrid 0.01154 → 0.00916; benchmarks/README.md "Where the W8A8 part's KL comes
# from")
_KEEP_DENSE_DOWN = {"keep_dense_down": (False, True)}
_KEEPS = {"kept": KEEP, "router": KEEP, "embedding": KEEP, "norm": KEEP, "mtp_extra": KEEP,
          VISION: KEEP}  # fmt: skip
register_recipe(
    RuleRecipe(
        "ascend-hybrid",
        "2×910B4 + Kunpeng: NPU W8A8_DYNAMIC (MLA, dense, shared) + routed experts in CPU INT4 per-channel (--cpu-group-size: group-wise; repacked losslessly from an INT4 group-quantized source); AWQ-calibrated experts with --calib-data",
        rules={
            "attention": _W8A8,
            "absorbed": KEEP,
            "dense": _W8A8,
            "shared": _W8A8,
            "routed": CPU_INT4,
            QUANTIZED_VISION: _W8A8,
            **_KEEPS,
        },
        choices={
            **_MTP,
            "cpu_group_size": (None, *CPU_GROUP_SIZES),
            "calib_gptq": (False, True),
            **_KEEP_DENSE_DOWN,
        },
        calibrates=True,
        records_rtn=False,
        search=frozenset({"routed"}),
        tags=("ascend", "w8a8", "int8", "int4", "cpu-offload"),
        serving=serving.VLLM_ASCEND,
    )
)
register_recipe(
    RuleRecipe(
        "ascend-w8a8",
        "8×910B int8: W8A8_DYNAMIC everywhere the hybrid uses it, routed experts included",
        rules={
            "attention": _W8A8,
            "absorbed": KEEP,
            "dense": _W8A8,
            "shared": _W8A8,
            "routed": _W8A8,
            QUANTIZED_VISION: _W8A8,
            **_KEEPS,
        },
        choices={**_MTP, **_KEEP_DENSE_DOWN},
        tags=("ascend", "w8a8", "int8"),
        serving=serving.VLLM_ASCEND,
    )
)
register_recipe(
    RuleRecipe(
        "awq-w4a16",
        "AutoAWQ GEMM w4a16 (group 128 or 64) for every linear but router and lm_head; AWQ-calibrated with --calib-data, else round-to-nearest",
        rules={
            "attention": _AWQ,
            "absorbed": _AWQ,
            "dense": _AWQ,
            "shared": _AWQ,
            "routed": _AWQ,
            QUANTIZED_VISION: _AWQ,  # refused by the plan: no engine reads it
            **_KEEPS,
        },
        choices={**_MTP, "group_size": (128, 64)},
        calibrates=True,
        tags=("awq", "int4", "w4a16"),
        serving=serving.AWQ,
    )
)
register_recipe(RuleRecipe(
    "fp4", "NVFP4 (E2M1 + E4M3 per 16 + F32 global) for dense MLP and experts, Ascend 8×8 tiled layout by default",
    rules={"attention": KEEP, "absorbed": KEEP, "dense": FP4, "shared": FP4, "routed": FP4, QUANTIZED_VISION: FP4, **_KEEPS},
    choices={**_MTP, "fp4_layout": ("ascend", "nvfp4")}, tags=("nvfp4", "fp4"),))  # fmt: skip
register_recipe(RuleRecipe(
    "ct-w4a16",
    "compressed-tensors pack-quantized W4A16 (symmetric, group 32 or 128) for the routed experts, the rest at source precision, as vllm-ascend's W4A16 MoE and vLLM load it; AWQ-calibrated with --calib-data, else round-to-nearest",
    rules={"attention": KEEP, "absorbed": KEEP, "dense": KEEP, "shared": KEEP, "routed": FORMATS["ct_pack_quantized"], QUANTIZED_VISION: FORMATS["ct_pack_quantized"], **_KEEPS},
    choices={**_MTP, "group_size": (32, 128)},
    calibrates=True, tags=("compressed-tensors", "int4", "w4a16"), serving=serving.COMPRESSED_TENSORS,))  # fmt: skip
