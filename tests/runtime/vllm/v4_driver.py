"""Run in the vLLM venv's python: DeepSeek-V4 through vLLM 0.32's CPU build, which cannot serve
it as shipped. ``python v4_driver.py SPEC.json OUT.json``; SPEC: ``{"prompts", "max_tokens",
"model", "workarounds": bool, "keys": PATH, "plugin": bool}`` (``plugin``: through
``--quantization hetquant --load-format hetquant``; bfloat16 either way: q must be bf16); OUT:
``{"tokens", "logprobs", "seconds"}`` or ``{"error": "Type: message"}``, and ``"cache": PATH``
when ``keys`` was given; ``"routing": PATH`` when ``routing`` (a count) was given.

Two defects of vLLM 0.32's CPU V4 stop every request (``workarounds: false`` shows them):

1. the attention metadata builder launches Triton kernels (``v1/attention/ops/metadata.py:43``
   ``compute_token_to_req_indices``, from ``v1/attention/backends/mla/sparse_swa.py:610``); the
   CPU build disables Triton unless it has a CPU backend (``triton_utils/importing.py:36-48``;
   triton-cpu is not on PyPI), so the launch fails: "TypeError: 'function' object is not
   subscriptable";
2. ``models/deepseek_v4/cpu/cpu_mla.py:122-126`` returns a tile-scheduler dict without the
   ``c1a`` / ``c2a`` keys that ``sparse_swa.py:780-781`` reads: ``KeyError: 'c1a'``.

``workarounds: true`` runs vLLM's own code past both, in this process only: Triton's interpreter
(``TRITON_INTERPRET=1``) stands in for the missing CPU backend — those kernels compute slot and
request indices, integers, which the interpreter evaluates exactly — and the tile-scheduler dict
answers None for every layer type (what the CPU override means: it never plans tiles). Nothing
else of vLLM is touched.

``keys``: a ``torch.save``d bfloat16 [S, 512] tensor written into a fp8_ds_mla SWA cache by
vLLM's ``fused_qnorm_rope_kv_insert_cpu`` (the op ``cpu/cpu_sparse.py:431`` calls) at positions
0..S-1 with a zero rope (cos 1, sin 0: the rope channels pass unrotated); the rows read back
(FP8 codes times their UE8M0 scales, the bf16 tail) are saved to ``cache`` as float32 [S, 512].
"""

from __future__ import annotations

import json
import os
import sys
import time

BLOCK = 64  # tokens per cache block here
ROW, SCALES, NOPE, ROPE = 576, 8, 448, 64  # bytes per token row and its scales; channels


def _workarounds() -> None:
    """Both defects of the module docstring, before vLLM is imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends

    class _Interpreter:  # the "cpu" backend vLLM's check looks for; TRITON_INTERPRET runs it
        @staticmethod
        def is_active() -> bool:
            return True

    backends.setdefault("cpu", Backend(compiler=None, driver=_Interpreter))  # type: ignore[arg-type]
    from collections import defaultdict

    from vllm.models.deepseek_v4.cpu import cpu_mla

    def no_tiles(self, num_decode_tokens):  # type: ignore[no-untyped-def]
        return defaultdict(lambda: None)

    cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = no_tiles


def capture_routing(limit: int) -> list[dict]:
    """The first ``limit`` calls of the plugin's ``CpuPoolMoEMethod.apply`` (a hybrid's routed
    experts): the MoE layer, the token ids vLLM's ``DeepseekV4MoE.forward`` got (its hash layers
    route by them), x, vLLM's ``topk_ids`` / ``topk_weights``, the SwiGLU clip the method passes
    the pool, and the method's output; filled in while the engine runs in this process."""
    from vllm.models.deepseek_v4.cpu import model as v4

    from hetquant.runtime.vllm import moe

    calls: list[dict] = []
    seen: dict = {}
    forward, apply = v4.DeepseekV4MoE.forward, moe.CpuPoolMoEMethod.apply

    def moe_forward(self, hidden_states, input_ids=None):  # type: ignore[no-untyped-def]
        seen["ids"] = input_ids
        return forward(self, hidden_states, input_ids)

    def pool_apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs)
        if len(calls) < limit:
            ids = seen.get("ids")
            calls.append({
                "layer": self.layer_no, "tokens": None if ids is None else ids.clone(),
                "x": x.clone(), "topk_ids": topk_ids.clone(), "topk_weights": topk_weights.clone(),
                "limit": self.limit, "out": out.clone(),
            })  # fmt: skip
        return out

    v4.DeepseekV4MoE.forward = moe_forward
    moe.CpuPoolMoEMethod.apply = pool_apply
    return calls


def cache_rows(keys_path: str, out_path: str) -> None:
    """The ``keys`` check of the module docstring."""
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    kv = torch.load(keys_path)
    s = kv.shape[0]
    q = torch.zeros(s, 1, NOPE + ROPE, dtype=torch.bfloat16)
    cache = torch.zeros(-(-s // BLOCK), BLOCK * (ROW + SCALES), dtype=torch.uint8)
    cos_sin = torch.cat([torch.ones(s, ROPE // 2), torch.zeros(s, ROPE // 2)], -1)
    pos = torch.arange(s)
    torch.ops._C.fused_qnorm_rope_kv_insert_cpu(q, kv, pos, cache, pos, cos_sin, 1, 1e-6, BLOCK)
    data = cache[:, : BLOCK * ROW].reshape(-1, ROW)[:s]
    scales = cache[:, BLOCK * ROW :].reshape(-1, SCALES)[:s, : NOPE // 64]
    codes = data[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float()
    nope = codes * torch.exp2(scales.float() - 127).repeat_interleave(64, 1)
    tail = data[:, NOPE:].contiguous().view(torch.bfloat16).float()
    torch.save(torch.cat([nope, tail], -1), out_path)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if spec["workarounds"]:
        _workarounds()
    from vllm_driver import run_case

    out: dict = {}
    if spec.get("keys"):
        out["cache"] = spec["keys"] + ".cache"
        cache_rows(spec["keys"], out["cache"])
    calls = capture_routing(spec["routing"]) if spec.get("routing") else None
    case = {"model": spec["model"], "plugin": spec.get("plugin", False), "dtype": "bfloat16"}
    t0 = time.perf_counter()
    try:
        out |= run_case(case, spec["prompts"], spec["max_tokens"])
    except Exception as e:  # the engine's failure, reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.perf_counter() - t0
    if calls is not None:
        import torch

        out["routing"] = sys.argv[2] + ".routing.pt"
        torch.save(calls, out["routing"])
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
