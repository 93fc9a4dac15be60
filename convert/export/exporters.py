"""Exporters: an artifact's CPU experts in another engine's file layout (``hetquant export``).

An exporter says, for one MoE layer of the artifact's ``cpu_experts`` part (an
:class:`ExpertLayer`: shapes and format only) and a NUMA count, which files each expert goes to
(``outputs``: file, tensor, key, dtype and shape) and how one expert's stored tensors become those
bytes (``convert``) — a lossless repack, never a re-quantization. ``export/run.py`` lays the
files out, runs the jobs and writes the manifest. Registered by name in ``EXPORTERS``; a new
engine's layout is one more class here.

| ``--to`` | source layers | what is written |
|---|---|---|
| ``kt-amxint4`` | ``int4_cpu_experts`` (per-row F32 scales) | kt-kernel's AMXINT4 ``.kt`` tree: ``_layer_{L}/_numa_{N}/INT4_{proj}_{E}_{B}Byte_{quant,scale}_.kt`` (``formats/kt_amxint4.py``), loaded with ``--kt-method AMXINT4 --kt-threadpool-count N`` |
| ``kt-rawint4`` | ``int4_cpu_group_experts`` (BF16 group scales) | compressed-tensors pack-quantized per expert linear (``{prefix}.{E}.{proj}_proj.weight_packed / weight_scale / weight_shape``, ``formats/ct_pack_quantized.py``), one ``layer_{L:03d}.safetensors`` per layer: what kt-kernel's ``RAWINT4`` reads (reference/cpu_experts.md §7.2) |
| ``kt-mxfp4`` | ``fp4_cpu_experts`` (DeepSeek-V4's FP4 experts) | DeepSeek-V4's own per-expert tensors (``{prefix}.{E}.w{1,3,2}.weight`` I8 [N, K/2], prefix ``layers.{L}.ffn.experts`` or ``mtp.0.ffn.experts`` as in the checkpoint, ``.scale`` F8_E8M0 [N, K/32], ``formats/fp4_e2m1.py``), one ``layer_{L:03d}.safetensors`` per layer: what kt-kernel 0.7.2's ``MXFP4`` reads (``kt_kernel/utils/loader.py:1198-1309`` ``MXFP4SafeTensorLoader``: names ``{base}.ffn.experts.{i}.{w1,w3,w2}.{weight,scale}``, ``base`` ``model.layers.{L}`` with ``model.`` stripped, ``utils/amx.py:777``; codes viewed as U8, scales shifted to BF16 itself) — a pure repack: gate / up rows de-interleaved, bytes unchanged |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hetquant.formats import HetquantError, TensorMeta, get_format
from hetquant.formats import kt_amxint4 as amx
from hetquant.formats._lazy import torch

__all__ = ["EXPORTERS", "ExpertLayer", "Exporter", "Output", "get_exporter"]

PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer of a source artifact's cpu_experts, shape-only (recorded in the manifest)."""

    layer: int
    file: str  # relative to the artifact
    prefix: str  # e.g. model.layers.3.mlp.experts
    fmt: str  # expert-layer format name
    params: dict[str, Any] = field(default_factory=dict, hash=False)
    num_experts: int = 0
    hidden: int = 0
    inter: int = 0


@dataclass(frozen=True)
class Output:
    """One tensor an expert's job writes: whole tensor ``tensor`` of ``file``, ``key`` in the dict
    ``convert`` returns."""

    file: str
    tensor: str
    key: str
    meta: TensorMeta


def _views(layer: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's int4_cpu* / fp4_cpu slices → gate, up, down (packed [rows, k/2], scale)."""
    gu, gus = layer["gate_up_packed"], layer["gate_up_scale"]
    return {
        "gate": (gu[0::2], gus[0::2]),
        "up": (gu[1::2], gus[1::2]),
        "down": (layer["down_packed"], layer["down_scale"]),
    }


class Exporter:
    name: ClassVar[str]
    source_fmt: ClassVar[str]  # the expert-layer format it repacks losslessly
    container: ClassVar[str]  # convert/planning/containers.py kind of its files

    def check(self, layer: ExpertLayer, numa: int) -> None:
        """Raise HetquantError naming the layer unless it can be exported with ``numa`` slices."""
        if layer.fmt != self.source_fmt:
            raise HetquantError(
                f"layer {layer.layer} ({layer.file}): its experts are {layer.fmt} "
                f"{layer.params or ''}; --to {self.name} repacks {self.source_fmt} only "
                f"(lossless); {_OTHER.get(layer.fmt, 'no kt layout holds it')}"
            )
        if numa < 1 or layer.inter % numa:
            raise HetquantError(
                f"layer {layer.layer}: --numa {numa} does not divide the moe intermediate size "
                f"{layer.inter}; kt-kernel splits it into equal NUMA slices"
            )

    def outputs(self, layer: ExpertLayer, numa: int, e: int) -> list[Output]:
        raise NotImplementedError

    def convert(
        self, layer: ExpertLayer, numa: int, expert: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """One expert's stored slices (``LAYER_KEYS`` without the expert dim) → ``key`` → bytes."""
        raise NotImplementedError


_OTHER = {
    "int4_cpu_experts": "use --to kt-amxint4",
    "int4_cpu_group_experts": "use --to kt-rawint4",
    "fp4_cpu_experts": "use --to kt-mxfp4",
}


class KtAmxInt4(Exporter):
    """kt-kernel AMXINT4 ``.kt`` files per layer and NUMA slice (formats/kt_amxint4.py)."""

    name = "kt-amxint4"
    source_fmt = "int4_cpu_experts"
    container = "raw"

    def check(self, layer: ExpertLayer, numa: int) -> None:
        super().check(layer, numa)
        i, h = layer.inter // numa, layer.hidden
        amx.check_shape(f"layer {layer.layer} gate/up slice [I/{numa}, H]", i, h)
        amx.check_shape(f"layer {layer.layer} down slice [H, I/{numa}]", h, i)

    def outputs(self, layer: ExpertLayer, numa: int, e: int) -> list[Output]:
        i, h = layer.inter // numa, layer.hidden
        out = []
        for s in range(numa):
            for proj in PROJS:
                rows, k = (h, i) if proj == "down" else (i, h)
                for kind, meta in (("quant", TensorMeta("U8", (rows * k // 2,))),
                                   ("scale", TensorMeta("F32", (rows,)))):  # fmt: skip
                    name = f"_layer_{layer.layer}/_numa_{s}/{amx.file_name(proj, e, meta.nbytes, kind)}"  # fmt: skip
                    out.append(Output(name, name, f"{s}/{proj}/{kind}", meta))
        return out

    def convert(
        self, layer: ExpertLayer, numa: int, expert: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        i = layer.inter // numa
        out = {}
        for proj, (packed, scale) in _views(expert).items():
            what = f"layer {layer.layer} {proj}"
            d = amx.scale_file(what, scale)
            for s in range(numa):
                if proj == "down":  # columns [s·i, (s+1)·i) of every row; the row's scale
                    part, ds = packed[:, s * i // 2 : (s + 1) * i // 2], d
                else:  # rows [s·i, (s+1)·i)
                    part, ds = packed[s * i : (s + 1) * i], d[s * i : (s + 1) * i]
                out[f"{s}/{proj}/quant"] = amx.quant_file(part.contiguous())
                out[f"{s}/{proj}/scale"] = ds.contiguous()
        return out


class KtRawInt4(Exporter):
    """compressed-tensors pack-quantized expert linears, as kt-kernel's RAWINT4 reads them."""

    name = "kt-rawint4"
    source_fmt = "int4_cpu_group_experts"
    container = "safetensors"

    def _ct(self, layer: ExpertLayer) -> Any:
        return get_format("ct_pack_quantized", group_size=layer.params["group_size"])

    def check(self, layer: ExpertLayer, numa: int) -> None:
        super().check(layer, numa)
        if numa != 1:  # measured: benchmarks/kt_check.py, benchmarks/README.md
            raise HetquantError(
                f"--numa {numa}: kt-kernel 0.7.2 runs RAWINT4 with --kt-threadpool-count 1 only "
                '("per-expert pointer mode requires kt_threadpool_count=1"); the files have no '
                "NUMA slices, export with --numa 1"
            )
        self._ct(layer)  # refuses a group size compressed-tensors does not write

    def outputs(self, layer: ExpertLayer, numa: int, e: int) -> list[Output]:
        return _per_projection(layer, e, self._ct(layer), {p: f"{p}_proj" for p in PROJS})

    def convert(
        self, layer: ExpertLayer, numa: int, expert: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = {}
        for proj, (packed, scale) in _views(expert).items():
            rows, k = packed.shape[0], 2 * packed.shape[1]
            out[f"{proj}/weight_packed"] = packed.contiguous().view(torch.int32)  # same bytes
            out[f"{proj}/weight_scale"] = scale.contiguous()
            out[f"{proj}/weight_shape"] = torch.tensor([rows, k], dtype=torch.int64)
        return out


class KtMxfp4(Exporter):
    """DeepSeek-V4's FP4 expert tensors, as kt-kernel's MXFP4 method reads them (module table)."""

    name = "kt-mxfp4"
    source_fmt = "fp4_cpu_experts"
    container = "safetensors"
    _PROJ: ClassVar[dict[str, str]] = {"gate": "w1", "up": "w3", "down": "w2"}  # DeepSeek's

    def check(self, layer: ExpertLayer, numa: int) -> None:
        super().check(layer, numa)
        if numa != 1:
            raise HetquantError(
                f"--numa {numa}: kt-kernel 0.7.2 hands MXFP4 experts to its kernel as one "
                "pointer list (kt_kernel/utils/amx.py:842, one NUMA slice) and splits them "
                "itself; the files have no NUMA slices, export with --numa 1"
            )

    def outputs(self, layer: ExpertLayer, numa: int, e: int) -> list[Output]:
        return _per_projection(
            layer, e, get_format("fp4_e2m1"), self._PROJ
        )  # layers.L.ffn.experts, mtp.0.…

    def convert(
        self, layer: ExpertLayer, numa: int, expert: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = {}
        for proj, (packed, scale) in _views(expert).items():
            out[f"{proj}/weight"] = packed.contiguous().view(
                torch.int8
            )  # DeepSeek's I8: same bytes
            out[f"{proj}/scale"] = scale.contiguous()
        return out


EXPORTERS: dict[str, Exporter] = {x.name: x for x in (KtAmxInt4(), KtRawInt4(), KtMxfp4())}


def get_exporter(name: str) -> Exporter:
    try:
        return EXPORTERS[name]
    except KeyError:
        raise HetquantError(
            f"unknown export target {name!r}; known: {', '.join(sorted(EXPORTERS))}"
        ) from None


def _per_projection(layer: ExpertLayer, e: int, fmt: Any, names: Mapping[str, str]) -> list[Output]:
    """Expert ``e``'s tensors in one per-layer safetensors file, one linear of ``fmt`` per
    projection (gate/up [I, H], down [H, I]) named ``{prefix}.{e}.{names[proj]}.{key}``."""
    file = f"layer_{layer.layer:03d}.safetensors"
    h, i = layer.hidden, layer.inter
    return [
        Output(file, f"{layer.prefix}.{e}.{names[proj]}.{key}", f"{proj}/{key}", meta)
        for proj in PROJS
        for key, meta in fmt.stored((h, i) if proj == "down" else (i, h)).items()
    ]
