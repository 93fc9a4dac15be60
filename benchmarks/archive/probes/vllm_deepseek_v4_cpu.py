"""Probe (issue #29 part 3, not a CI stage): can vLLM 0.32's CPU build serve the tiny DeepSeek-V4
bf16 artifact? Run it with the vLLM venv's python::

    /work/main/.venv-vllm/bin/python benchmarks/archive/probes/vllm_deepseek_v4_cpu.py ARTIFACT

It prints ``TOKENS [...]`` (greedy, 8 tokens after the prompt below) or ``REFUSED`` with the
error. Result (2026-11-28, the bf16 artifact of ``examples/tiny-deepseek-v4`` DeepSeek layout):
REFUSED. vLLM 0.32 CPU does build V4 (``vllm/models/deepseek_v4/__init__.py:34-39`` picks
``cpu/model.py``), but

1. the tiny DeepSeek-layout config.json omits ``hc_eps``, ``hc_sinkhorn_iters`` and ``hidden_act``,
   which vLLM's V4 reads without a default (``cpu/model.py:468``: AttributeError) — passed here as
   ``hf_overrides`` (the released V4 configs carry them);
2. then the compressor refuses the tiny's dims: ``compressor.py:295-314`` supports head_dim 512
   (main KV) or 128 (indexer) only — "Unsupported head_dim for fused quant+cache: 32" (the
   indexer's, ``index_head_dim`` 32; reached from ``attention.py:1022`` via
   ``cpu/cpu_sparse.py:274``). The CPU kernels in ``_C.abi3.so`` check the same
   ("compress_norm_rope_store_cpu: rms_norm_weight must have head_dim (512) entries",
   "fp8_paged_mqa_logits_cpu: q_fp8 head_dim must be 128");
3. and even at V4's dims the CPU attention keeps KV in FP8 only (``fp8_ds_mla``:
   ``attention.py:106-122``, ``cpu/cpu_sparse.py:401-426``), so its greedy tokens would not be
   expected to equal ``hetquant run``'s (float KV) bit for bit.

Superseded (2026-11-28, branch v4vllm): ``make_tiny.py --dims vllm`` builds the tiny V4 at the
dimensions vLLM's CPU kernels take (item 2; its config carries item 1's keys), and
``tests/runtime/vllm/test_vllm_deepseek_v4.py`` serves it: stock vLLM 0.32 then fails at the first
request on two more defects (Triton kernels without a CPU backend; a tile-scheduler dict without
``c1a``; ``tests/runtime/vllm/v4_driver.py`` names the lines), which its driver works around; item
3 is ``hetquant run --kv-cache fp8_ds_mla``.

``hetquant run`` on the same artifact and prompt, for comparison: 276, 52, 535, 85, 456, 239,
199, 535.
"""

import sys
import traceback

PROMPT = [5, 17, 42, 100, 7, 300, 250, 11]
OVERRIDES = {"hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "hidden_act": "silu"}  # item 1


def main() -> None:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256,
                  seed=0, gpu_memory_utilization=0.1, hf_overrides=OVERRIDES)  # fmt: skip
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
        print("TOKENS", list(out[0].outputs[0].token_ids))
    except Exception as e:  # the engine's start-up error: report it
        print("REFUSED", type(e).__name__, str(e).splitlines()[0][:400])
        for frame in traceback.extract_tb(e.__traceback__)[-4:]:
            print("  at", frame.filename, frame.lineno, frame.name)


if __name__ == "__main__":
    main()
