"""Linear methods for ``--quantization hetquant``: one per stored format, vLLM's kernel where it
has one for the format on this device, ours (``runtime/kernels/ops.py``) otherwise.

``LINEAR_METHODS`` maps a format name to a method factory; a format it does not name runs through
:class:`HetquantLinearMethod`, which covers every registered format on the CPU (bf16, w8a8_dynamic,
w8a8, w4a8_dynamic, awq_w4a16, ct_pack_quantized, int4_cpu, nvfp4, nvfp4_ascend; the table in
``ops.py`` says what each runs). A fused vLLM layer whose parts are stored in different formats
runs through ours too. vLLM's, by format: bf16 — ``UnquantizedLinearMethod``; w8a8_dynamic —
``CPUInt8ScaledMMLinearKernel`` (:class:`VllmInt8DynamicMethod`); awq_w4a16 — its AWQ method for
bf16 / fp16 activations, ours in float32 (:func:`_vllm_awq`, :class:`ByActivationDtype`).

vLLM's interface: ``LinearMethodBase`` (``vllm/model_executor/layers/linear.py:123``):
``create_weights`` gets this rank's ``input_size_per_partition`` and ``output_partition_sizes``
(one per fused part); ``apply(layer, x, bias)`` returns ``x @ Wᵀ (+ bias)``;
``process_weights_after_loading`` runs once after the loader (``base_config.py:80``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    RowParallelLinear,
    UnquantizedLinearMethod,
)

from hetquant.formats import HetquantError

from ..kernels.ops import QuantLinear
from .sources import Source, expect, shared_format, take

__all__ = [
    "DENSE_READ",
    "DENSE_READ_ROLES",
    "LINEAR_METHODS",
    "ByActivationDtype",
    "DenseReadLinearMethod",
    "HetquantLinearMethod",
    "VllmInt8DynamicMethod",
    "dense_weight",
    "int8_kernel",
    "linear_method",
]


class HetquantLinearMethod(LinearMethodBase):
    """Our kernels: one ``QuantLinear`` per stored part, outputs concatenated in part order."""

    def __init__(self, sources: Sequence[Source], prefix: str) -> None:
        self.sources, self.prefix = tuple(sources), prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        outs = tuple(output_partition_sizes)
        if len(outs) != len(self.sources) and len(self.sources) == 1:
            # one stored module holding all of vLLM's parts, in its order (Kimi K2.5's vision
            # ``wqkv``, which vLLM's own loader copies whole): its rows, the shape check below
            outs = (sum(outs),)
        if len(outs) != len(self.sources):
            raise HetquantError(
                f"{self.prefix}: vLLM fuses {len(output_partition_sizes)} parts here, the "
                f"artifact stores {[s.prefix for s in self.sources]}"
            )
        expect(layer, self.sources)
        layer.hetquant_shape = (outs, input_size_per_partition)
        # vLLM reads a quantized layer's dense weight by applying it to an identity matrix
        # (``get_and_maybe_dequant_weights``, ``quant_utils.py:511``: MLA's kv_b_proj), after
        # looking up ``weight`` / ``qweight`` / ``weight_packed`` for its device and dtype: an
        # empty ``weight`` of the activation dtype answers that, and holds no bytes.
        layer.register_buffer("weight", torch.empty(0, dtype=params_dtype), persistent=False)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        tensors = take(layer, self.prefix)
        rank = getattr(layer, "tp_rank", 0) if isinstance(layer, RowParallelLinear) else 0
        outs, k = layer.hetquant_shape
        ops = []
        for src, n in zip(self.sources, outs, strict=True):
            assert src.fmt is not None
            op = QuantLinear.from_stored(
                src.fmt, tensors[src.prefix], backend="cpu", params=src.params, tp_rank=rank
            )
            if (op.out_features, op.in_features) != (n, k):
                raise HetquantError(
                    f"{src.prefix}: this rank's stored weight is [{op.out_features}, "
                    f"{op.in_features}], vLLM's layer wants [{n}, {k}]"
                )
            ops.append(op)
        layer.hetquant_ops = ops

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        ys = [op(x) for op in layer.hetquant_ops]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if bias is None else y + bias


class DenseReadLinearMethod(HetquantLinearMethod):
    """A layer whose ``weight`` vLLM's model reads itself, not through ``apply``: DeepSeek-V4's
    ``wo_a`` on the CPU, which vLLM dequantizes to bfloat16 for its grouped ``bmm_cpu``
    (``models/deepseek_v4/cpu/cpu_sparse.py:108-145`` ``_dequant_linear_weight``, wrapped around
    the quant method's ``process_weights_after_loading`` at ``:308-335``, then freed). vLLM does
    that for its own FP8 blocks; for ours the loader puts the stored weight, dequantized
    (:func:`dense_weight`), in ``layer.weight`` before that hook reads it. So vLLM runs the layer
    on bfloat16 weights and activations: our W8A8 ``wo_a``'s weight rounding is kept, its
    per-token activation quantization is not (``apply`` still runs our kernel, for any caller)."""

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().create_weights(layer, *args, **kwargs)
        setattr(layer, DENSE_READ, True)


DENSE_READ = "hetquant_dense_read"  # layer attribute: the loader fills ``weight`` (dense_weight)


def dense_weight(layer: torch.nn.Module, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """``layer.weight`` [sum(outs), k] from its stored parts, each dequantized by applying our
    kernel to the identity (what vLLM's ``get_and_maybe_dequant_weights`` does), in the layer's
    dtype; ``tensors`` stay the loader's, for ``process_weights_after_loading``."""
    method = layer.quant_method
    outs, k = layer.hetquant_shape
    eye = torch.eye(k, dtype=torch.float32)
    rows = []
    for src in method.sources:
        op = QuantLinear.from_stored(src.fmt, tensors[src.prefix], backend="cpu", params=src.params)
        rows.append(op(eye).to(torch.float32).T)
    dense = torch.cat(rows)
    if dense.shape != (sum(outs), k):
        raise HetquantError(
            f"{method.prefix}: the stored weight is {list(dense.shape)}, vLLM's layer wants "
            f"[{sum(outs)}, {k}]"
        )
    dtype = layer.weight.dtype
    layer.register_buffer("weight", dense.to(dtype).contiguous(), persistent=False)


LinearFactory = Callable[[Sequence[Source], str], LinearMethodBase]


def _vllm_unquantized(sources: Sequence[Source], prefix: str) -> LinearMethodBase:
    return UnquantizedLinearMethod()  # vLLM loads it from our tensors (loader.py)


class ByActivationDtype(LinearMethodBase):
    """vLLM's method where its kernel takes the layer's activation dtype, ours otherwise: the
    choice is made in ``create_weights``, where vLLM first tells the dtype."""

    def __init__(
        self, vllm: Callable[[], LinearMethodBase], dtypes: frozenset[torch.dtype],
        sources: Sequence[Source], prefix: str,
    ) -> None:  # fmt: skip
        self.vllm, self.dtypes, self.sources, self.prefix = vllm, dtypes, sources, prefix
        self.impl: LinearMethodBase | None = None

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        use_vllm = params_dtype in self.dtypes
        self.impl = self.vllm() if use_vllm else HetquantLinearMethod(self.sources, self.prefix)
        layer.hetquant_kernel = "vllm" if use_vllm else "hetquant"
        self.impl.create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
            params_dtype, **extra_weight_attrs,
        )  # fmt: skip

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        assert self.impl is not None
        self.impl.process_weights_after_loading(layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert self.impl is not None
        return self.impl.apply(layer, x, bias)


class VllmInt8DynamicMethod(HetquantLinearMethod):
    """W8A8_DYNAMIC (symmetric per-channel int8 weights, per-token dynamic int8 activations)
    through vLLM's own ``CPUInt8ScaledMMLinearKernel`` (``kernels/linear/scaled_mm/cpu.py:33``:
    oneDNN, or sgl's AMX kernel where the CPU has AMX, :46-60); a fused layer's parts stacked on
    the output dim, their per-channel scales likewise. sgl's kernel takes bf16 / fp16 activations
    only (``int8_scaled_mm_with_quant``, :212-224: "expect A to be bfloat16 or half"), and vLLM
    picks it by the CPU and the weight's shape alone, so with float32 activations on an AMX CPU
    vLLM's own layer fails; this method then takes the kernel's oneDNN route (:188-210), which
    computes in the activations' dtype — what every CPU without AMX runs."""

    NAMES = ("hetquant_w", "hetquant_w_scale", "hetquant_x_scale", "hetquant_x_zp", "hetquant_azp")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        tensors = take(layer, self.prefix)
        outs, k = layer.hetquant_shape
        weights, scales = [], []
        for src, n in zip(self.sources, outs, strict=True):
            t = tensors[src.prefix]
            if tuple(t["weight"].shape) != (n, k) or bool(t["weight_offset"].any()):
                raise HetquantError(
                    f"{src.prefix}: this rank's int8 weight is {list(t['weight'].shape)} with "
                    f"offsets {'non-zero' if t['weight_offset'].any() else 'zero'}; vLLM's layer "
                    f"wants [{n}, {k}], symmetric"
                )
            weights.append(t["weight"])
            scales.append(t["weight_scale"].reshape(-1, 1).float())
        layer.hetquant_w = torch.nn.Parameter(torch.cat(weights), requires_grad=False)
        layer.hetquant_w_scale = torch.nn.Parameter(torch.cat(scales), requires_grad=False)
        layer.logical_widths = list(outs)  # the kernel reads it (vLLM's quant methods set it)
        for name in self.NAMES[2:]:  # dynamic, symmetric: no input scale, zero point, adjustment
            setattr(layer, name, None)
        layer.hetquant_int8 = int8_kernel(layer, self.NAMES)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return layer.hetquant_int8.apply_weights(layer, x, bias)


HALF = frozenset({torch.bfloat16, torch.float16})


def int8_kernel(layer: torch.nn.Module, names: tuple[str, ...]) -> Any:
    """vLLM's int8 kernel over ``layer``'s parameters ``names``, weights processed: vLLM's route
    for bf16 / fp16 activations (the model's dtype: ``params_dtype``, that of the empty
    ``layer.weight`` ``create_weights`` made), oneDNN's for any other
    (:class:`VllmInt8DynamicMethod` says why)."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        Int8ScaledMMLinearLayerConfig,
    )

    config = Int8ScaledMMLinearLayerConfig(
        is_static_input_scheme=False, is_channelwise=True, input_symmetric=True
    )
    kernel = CPUInt8ScaledMMLinearKernel(config, names)
    if layer.weight.dtype in HALF:
        kernel.process_weights_after_loading(layer)  # vLLM's choice: sgl's kernel or oneDNN
    else:  # its oneDNN route (cpu.py:46-60 would pick sgl's by the CPU and shape alone)
        kernel.linear_method = kernel._apply_weights_onednn
        kernel.process_weights_for_onednn(layer)
    return kernel


def _vllm_awq(sources: Sequence[Source], prefix: str) -> LinearMethodBase:
    """AutoAWQ GEMM (``qweight`` / ``qzeros`` / ``scales``) through vLLM's own AWQ method for
    bf16 / fp16 activations: on the CPU that is ``AutoAWQMarlinLinearMethod``
    (``quantization/auto_awq.py:307``), which repacks to GPTQ order and runs
    ``CPUWNA16LinearKernel`` (``kernels/linear/mixed_precision/cpu.py:20``,
    ``ops.cpu_gemm_wna16``, which has no float32 path: ``not implemented for 'Float'``), loaded by
    vLLM from our tensors (loader.py); float32 runs ours."""
    from vllm.model_executor.layers.quantization.auto_awq import (
        AutoAWQConfig,
        AutoAWQMarlinLinearMethod,
    )

    group = int(sources[0].params["group_size"])
    config = AutoAWQConfig(4, group, True, lm_head_quantized=False)
    return ByActivationDtype(lambda: AutoAWQMarlinLinearMethod(config), HALF, sources, prefix)


LINEAR_METHODS: dict[str, LinearFactory] = {
    "bf16": _vllm_unquantized,
    "awq_w4a16": _vllm_awq,
    "w8a8_dynamic": VllmInt8DynamicMethod,
}
"""Format → method factory, where one other than ours serves it (vLLM's own kernels)."""


DENSE_READ_ROLES: dict[str, frozenset[str]] = {"deepseek_v4": frozenset({"o_a"})}
"""Model family → the roles (formats/families/) whose weight vLLM's model reads itself
(:class:`DenseReadLinearMethod`)."""


def linear_method(
    sources: Sequence[Source], prefix: str, kernels: str = "vllm", dense_read: bool = False
) -> LinearMethodBase:
    """The method of the vLLM linear layer ``prefix`` whose stored parts are ``sources``;
    ``kernels`` (``served.KERNELS``): ``vllm`` takes ``LINEAR_METHODS``, ``hetquant`` ours;
    ``dense_read``: vLLM reads the layer's weight itself (``DENSE_READ_ROLES``)."""
    stored = [s for s in sources if s.stored]
    if not stored:  # a layer the artifact does not store: the loader's fill check names it
        return UnquantizedLinearMethod()
    if len(stored) != len(sources):
        missing = [s.prefix for s in sources if not s.stored]
        raise HetquantError(f"{prefix}: the artifact does not store {', '.join(missing)}")
    if dense_read and shared_format(sources) != "bf16":
        return DenseReadLinearMethod(sources, prefix)
    factory = HetquantLinearMethod
    if (fmt := shared_format(sources)) is not None and kernels == "vllm":
        factory = LINEAR_METHODS.get(fmt, HetquantLinearMethod)
    return factory(sources, prefix)
