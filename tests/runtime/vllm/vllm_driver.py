"""Run in the vLLM venv's python (not pytest's): greedy tokens of several artifacts, one at a time.

``python vllm_driver.py SPEC.json OUT.json``. SPEC: ``{"prompts": [[ids]], "max_tokens": 16,
"cases": [{"name", "model", "plugin": bool, "tp": int, "env": {}, "llm_kwargs": {}}],
"refusals": [case, ...], "ignore_checks": {name: {"config", "model_class", "layers"}}}``
(``ignored_by_vllm``, run before any engine). OUT: ``{name: {"tokens": [[ids]], "logprobs":
[[float]], "seconds": float}, "_refused": {name: "Type: message"}, "_ignored": {name:
{layer: bool}}, "_peak_rss_mb": float}`` (the whole session's RSS at its peak) — the logprob
vLLM gives each generated token, in float32. Each engine is shut down (its worker processes end)
before the next starts.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path


class SessionRss:
    """Peak of the summed RSS of every process in this session (this one, the engine core and
    its workers), sampled every 0.2 s from /proc."""

    def __init__(self) -> None:
        self.peak = 0

    def run(self) -> None:
        sid = os.getsid(0)
        while True:
            total = 0
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                    if int(fields[3]) == sid:  # field 6 of stat: the session id
                        total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss
                except (OSError, IndexError, ValueError):
                    continue
            self.peak = max(self.peak, total)
            time.sleep(0.2)


def run_case(case: dict, prompts: list, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kw = {"quantization": "hetquant", "load_format": "hetquant"} if case["plugin"] else {}
    llm = LLM(
        model=case["model"], dtype=case.get("dtype", "float32"), enforce_eager=True, max_model_len=256, seed=0,
        gpu_memory_utilization=0.1, tensor_parallel_size=case.get("tp", 1),
        **kw, **case.get("llm_kwargs", {}),
    )  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [
            [
                step[t].logprob
                for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ]
            for o in outs
        ]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"tokens": tokens, "logprobs": logprobs, "seconds": time.perf_counter() - t0}


def ignored_by_vllm(check: dict) -> dict[str, bool]:
    """Whether vLLM's compressed-tensors config leaves each of ``check["layers"]`` unquantized
    (``should_ignore_layer``, as ``CompressedTensorsConfig.get_quant_method`` asks it), with the
    packed-module mapping a fresh process's first model of ``check["model_class"]`` hands the
    config (its class attribute, before any engine here built one)."""
    import importlib

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
        should_ignore_layer,
    )

    module, _, cls = check["model_class"].rpartition(".")
    packed = dict(getattr(importlib.import_module(module), cls).packed_modules_mapping)
    qc = json.loads(Path(check["config"]).read_text())["quantization_config"]
    cfg = CompressedTensorsConfig.from_config(qc)
    return {name: should_ignore_layer(name, cfg.ignore, packed) for name in check["layers"]}


def _restore(before: dict[str, str | None]) -> None:
    """A case's environment undone, and vLLM's cache of it dropped: an engine core caches every
    VLLM_* variable once started (``envs.enable_envs_cache``, ``v1/engine/core.py:258``), which
    would hand the next engine in this process this case's values."""
    import vllm.envs

    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    vllm.envs.disable_envs_cache()


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_MLA_DISABLE", "1")  # the tiny model's latent is 160, not 576
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    # the engine core in this process: vLLM and torch are imported once for every engine (a
    # TP > 1 engine still starts its workers as processes)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out: dict = {}
    watch = SessionRss()
    threading.Thread(target=watch.run, daemon=True).start()
    out["_ignored"] = {n: ignored_by_vllm(c) for n, c in spec.get("ignore_checks", {}).items()}
    for case in spec["cases"]:
        env = case.get("env", {})
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out[case["name"]] = run_case(case, spec["prompts"], spec["max_tokens"])
        except Exception as e:  # recorded per case; the test names it
            out[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            _restore(before)
        gc.collect()  # the engine just shut down: its model and KV cache go before the next
        out["_peak_rss_mb"] = watch.peak / 2**20
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)
    out["_refused"] = {c["name"]: refusal(c, spec["prompts"]) for c in spec.get("refusals", [])}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


def refusal(case: dict, prompts: list) -> str | None:
    """The exception an engine that must not start raised (``Type: message``), None if it
    started; the refusal's own line may also be in the log, where a worker printed it."""
    env = case.get("env", {})
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_case(case, prompts[:1], 1)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        _restore(before)
        gc.collect()


if __name__ == "__main__":
    main()
