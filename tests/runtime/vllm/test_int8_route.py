"""The plugin's W8A8 layer on vLLM's int8 kernel (``runtime/vllm/linear.py`` ``int8_kernel``) as an
AMX CPU sees it: vLLM picks sgl's kernel there by the CPU and the weight's shape alone, which takes
bf16 / fp16 activations only, so float32 must take the kernel's oneDNN route and give the W8A8
product; bf16 keeps vLLM's choice. An x86 CPU with AMX is simulated (``check_cpu_sgl_kernel`` and
the platform's architecture patched), so this holds on any CPU; the real AMX path is run by
``test_vllm_serves.py`` on such a CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = r"""
import json, torch
import vllm.model_executor.kernels.linear.scaled_mm.cpu as C
from vllm.platforms.interface import CpuArchEnum
C.check_cpu_sgl_kernel = lambda n, k, dtype: True  # what an AMX CPU answers for these shapes
type(C.current_platform).get_cpu_architecture = classmethod(lambda cls: CpuArchEnum.X86)
chose_sgl = []
C.CPUInt8ScaledMMLinearKernel.process_weights_for_sgl = lambda self, layer: chose_sgl.append(1)
from hetquant.runtime.vllm.linear import int8_kernel

NAMES = ("w", "w_scale", "x_scale", "x_zp", "azp")
g = torch.Generator().manual_seed(0)
W = torch.randint(-127, 128, (64, 256), generator=g, dtype=torch.int8)
S = torch.rand(64, 1, generator=g) * 0.01 + 1e-3

def layer(dtype):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(W.clone(), requires_grad=False)
    m.w_scale = torch.nn.Parameter(S.clone(), requires_grad=False)
    for name in NAMES[2:]:
        setattr(m, name, None)
    m.logical_widths = [64]
    m.bias = None
    m.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)
    return m

f32 = layer(torch.float32)
kernel = int8_kernel(f32, NAMES)
x = torch.randn(5, 256, generator=g)
y = kernel.apply_weights(f32, x)
sx = x.abs().amax(dim=1, keepdim=True) / 127  # per token, symmetric
ref = (torch.round(x / sx) @ W.float().T) * sx * S.T
route = kernel.linear_method.__name__
int8_kernel(layer(torch.bfloat16), NAMES)
print(json.dumps({"route": route, "dtype": str(y.dtype), "shape": list(y.shape),
                  "rel_err": float((y - ref).abs().max() / ref.abs().max()),
                  "bf16_sgl": bool(chose_sgl)}))
"""


def test_float32_takes_onednn_where_vllm_would_take_sgl(vllm_python: Path) -> None:
    out = subprocess.run([str(vllm_python), "-c", SCRIPT], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["route"] == "_apply_weights_onednn"
    assert got["dtype"] == "torch.float32" and got["shape"] == [5, 64]
    assert got["rel_err"] < 1e-3  # one int8 step of a tie may round apart: within 1/127 of one term
    assert got["bf16_sgl"]  # bf16 activations: vLLM's own choice, sgl's kernel here
