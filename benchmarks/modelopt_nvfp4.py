"""ModelOpt's own NVFP4 export of the tiny model's MLPs, compared byte for byte with hetquant's.

Run in an environment with ``nvidia-modelopt`` (0.47.0 was used; it runs on the CPU) and
hetquant installed; it is not in the ``test`` extra (scipy, pulp, ninja, omegaconf: ~200 MB)::

    python benchmarks/modelopt_nvfp4.py [--write-golden]

What it does: every MLP linear of ``examples/tiny-deepseek-v3`` (dense MLP, shared expert,
routed experts, the MTP layer's too), dequantized exactly from the FP8 source, goes into a
module tree named as in DeepSeek's modeling code; ``mtq.quantize`` with ModelOpt's
``W4A16_NVFP4_CFG`` calibrates the weight amax; ModelOpt's export step
``requantize_resmooth_fused_llm_layers`` (``modelopt/torch/export/unified_export_hf.py:433``)
groups the linears that read one input by a forward hook (``collect_shared_input_modules``,
:280-348) and unifies their amax (``quant_utils.py:1490`` ``preprocess_linear_fusion``), routed
experts also by the ``experts.N`` name rule (:520-540); ``_export_quantized_weight`` (:569)
writes ``weight`` / ``weight_scale`` / ``weight_scale_2``. The forward gives every routed expert
its own copy of the input (DeepSeek's MoE indexes the tokens routed to it), so only each
expert's gate and up share one, as in the real model.

It then converts the same source with ``hetquant convert --recipe fp4 --fp4-layout nvfp4`` and
compares every stored tensor. ``--write-golden`` records the sha256 of ModelOpt's bytes per
module in ``tests/convert/golden_modelopt_nvfp4.json``, which ``tests/convert/test_fp4_fused.py``
checks hetquant's artifact against in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-deepseek-v3"
GOLDEN = REPO / "tests" / "convert" / "golden_modelopt_nvfp4.json"
KEYS = ("weight", "weight_scale", "weight_scale_2")


class Mlp(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(w) for w in (gate, up, down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Moe(nn.Module):
    def __init__(self, shared: Mlp, experts: list[Mlp]) -> None:
        super().__init__()
        self.shared_experts, self.experts = shared, nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = sum(e(x.clone()) for e in self.experts)  # each expert: its own tokens
        return self.shared_experts(x) + routed


class Layer(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


class Body(nn.Module):
    def __init__(self, layers: list[Layer], hidden: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(4, hidden, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(layers)


class Toy(nn.Module):
    """Just enough of an HF causal LM for ModelOpt's export helpers (config, device, forward)."""

    def __init__(self, body: Body) -> None:
        super().__init__()
        self.model = body
        self.config = type("Cfg", (), {"is_encoder_decoder": False, "use_cache": False})()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = x + layer.mlp(x)
        return x


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    return lin


def build(source) -> tuple[Toy, list[str]]:
    """The toy model over the source's MLP weights, and the quantized module names."""
    cfg, fam = source.config, source.config.family
    layers = []
    for layer in range(cfg.total_layers):

        def w(role: str, e: int | None = None, layer: int = layer) -> torch.Tensor:
            return source.dequantized(fam.tensor(role, layer, e))

        if cfg.is_moe_layer(layer):
            shared = Mlp(w("shared_gate"), w("shared_up"), w("shared_down"))
            experts = [
                Mlp(w("expert_gate", e), w("expert_up", e), w("expert_down", e))
                for e in range(cfg.num_experts)
            ]
            layers.append(Layer(Moe(shared, experts)))
        else:
            layers.append(Layer(Mlp(w("dense_gate"), w("dense_up"), w("dense_down"))))
    model = Toy(Body(layers, cfg.hidden_size))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return model, names


def modelopt_export(model: Toy, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.unified_export_hf import (
        _export_quantized_weight,
        requantize_resmooth_fused_llm_layers,
    )

    ids = torch.ones(1, 2, dtype=torch.long)
    mtq.quantize(model, mtq.W4A16_NVFP4_CFG, lambda m: m(ids))
    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)
        out = {}
        for name in names:
            module = model.get_submodule(name)
            _export_quantized_weight(module, torch.bfloat16)
            out[name] = {k: getattr(module, k).detach().clone() for k in KEYS}
    return out


def hetquant_export(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from hetquant.convert.cli import main

    args = ["convert", str(TINY), str(out), "--recipe", "fp4", "--fp4-layout", "nvfp4"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    if result.exit_code:
        raise SystemExit(result.output)
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
    return {
        name: {k: tensors[f"{name}.{k}"] for k in KEYS}
        for name in {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_scale_2")}
    }


def module_digest(t: dict[str, torch.Tensor]) -> str:
    """sha256 over the module's stored bytes, in KEYS order."""
    h = hashlib.sha256()
    for k in KEYS:
        h.update(_bytes(t[k]))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-golden", action="store_true")
    args = ap.parse_args()
    from hetquant.convert import SourceCheckpoint

    src = SourceCheckpoint.open(TINY)
    model, names = build(src)
    mo = modelopt_export(model, names)
    with tempfile.TemporaryDirectory() as tmp:
        hq = hetquant_export(Path(tmp) / "fp4")
    if set(hq) != set(mo):
        print(f"module sets differ: {sorted(set(hq) ^ set(mo))[:5]}")
        return 1
    equal = {n: all(_bytes(hq[n][k]) == _bytes(mo[n][k]) and hq[n][k].shape == mo[n][k].shape
                    for k in KEYS) for n in names}  # fmt: skip
    pairs = [n for n in names if n.endswith("gate_proj")]
    shared = sum(
        torch.equal(mo[n][KEYS[2]], mo[n.replace("gate_proj", "up_proj")][KEYS[2]]) for n in pairs
    )
    print(f"modules: {len(names)}, byte-identical to ModelOpt: {sum(equal.values())}")
    print(f"gate/up pairs sharing weight_scale_2 in ModelOpt's export: {shared} of {len(pairs)}")
    for n in [n for n, ok in equal.items() if not ok][:10]:
        print(f"  differs: {n}")
    if args.write_golden:
        doc = {
            "producer": "benchmarks/modelopt_nvfp4.py",
            "modelopt": _version("nvidia-modelopt"),
            "torch": torch.__version__,
            "source": "examples/tiny-deepseek-v3",
            "modules": {n: module_digest(mo[n]) for n in sorted(names)},
        }
        GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {GOLDEN.relative_to(REPO)}")
    return 0 if all(equal.values()) else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
