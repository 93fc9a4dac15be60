"""Issue 29 part 3, the hybrid through the plugin: the tiny DeepSeek-V4 (``make_tiny.py --dims
vllm``) ascend-hybrid artifact — attention and shared experts W8A8_DYNAMIC (vLLM's int8 kernel,
``runtime/vllm/linear.py``), the routed experts in our lossless FP4 CPU expert format run by our
``CpuExpertPool`` inside vLLM (``runtime/vllm/moe.py`` ``CpuPoolMoEMethod``) — served by real
vLLM 0.32 (CPU build) with ``--quantization hetquant --load-format hetquant``, against ``hetquant
run`` of the same artifact as ``test_vllm_deepseek_v4.py`` holds the bf16 one (the same two vLLM
defects worked around in the driver's process, the same prompts, teacher-forced logprob bound
with the fp8_ds_mla cache emulation, argmax agreement printed).

What the plugin does for V4 (``runtime/vllm/names.py``, ``linear.py``): vLLM's module names
(``model.layers.N.ffn.experts``, ``...shared_experts.down_proj``) are the artifact's through the
model's own ``hf_to_vllm_mapper``, inverted; ``wo_a``, whose weight vLLM's CPU attention reads
itself and dequantizes to bfloat16 (``cpu_sparse.py:108-145``, ``:308-335``), gets our W8A8
weight dequantized — so vLLM runs ``wo_a`` on bf16 activations where ``hetquant run`` quantizes
them per token (inside the bound). The source's ``swiglu_limit`` is set to 1.0 (10.0 in the
released configs never clips this random model: the pool's outputs were equal with and without
it), so the clip acts in every MoE call, in vLLM's shared experts and in our pool alike.

vLLM's own router (hash table for layer 0, sqrtsoftplus top-k with the correction bias after)
decides; each pool call's routing is captured in the driver and checked against the family's
routing here. One engine start, 31 s here (2 cores); the module 78 s with the fixtures it builds.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import run_cli
from test_vllm_deepseek_v4 import PROMPTS, STEPS, _drive, check_teacher_forced

from hetquant.runtime import ParallelLayout, open_artifact

LIMIT = 1.0  # swiglu_limit of the served source (module docstring)
CALLS = 64  # pool calls captured: the first prefill and decode steps, every MoE layer
# vLLM's router GEMM runs on bf16, ours here in float32 on the same x: scores and routing
# weights differ by up to 3e-4 (measured); a top-k set may differ only where the k-th and the
# next biased score are that close (measured: 3 rows of 832, margins 1.1e-4 … 4.5e-4)
WEIGHT_TOL = 1e-3


@pytest.fixture(scope="module")
def hybrid(vllm_python: Path, tiny_v4_vllm: dict[str, Path], tmp_path_factory) -> dict:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("vllm-v4-hybrid")
    src, art = tmp / "src", tmp / "ascend-hybrid"
    shutil.copytree(tiny_v4_vllm["deepseek"], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": LIMIT}))
    res = run_cli("convert", src, art, "--recipe", "ascend-hybrid")
    assert res.exit_code == 0, res.stderr
    spec = {"prompts": PROMPTS, "max_tokens": STEPS, "model": str(art), "workarounds": True,
            "plugin": True, "routing": CALLS}  # fmt: skip
    t0 = time.perf_counter()
    got = _drive(vllm_python, spec, tmp, "hybrid")
    print(f"\nvLLM V4 hybrid stage: {time.perf_counter() - t0:.0f} s")
    assert "error" not in got, got["error"]
    return {"got": got, "art": art, "calls": torch.load(got["routing"])}


def test_hybrid_experts_run_in_our_pool_inside_vllm(hybrid: dict) -> None:
    """Every MoE layer vLLM runs (the MTP layer is dropped by vLLM's CPU model) went through the
    plugin's pool method, with the artifact's clip."""
    art = open_artifact(hybrid["art"])
    layers = {c["layer"] for c in hybrid["calls"]}
    assert layers == set(range(art.cfg.num_hidden_layers))
    assert {c["limit"] for c in hybrid["calls"]} == {LIMIT}


def _family_routing(art, weights, call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """(expert ids [T, k], weights [T, E] scattered by id, each row's margin between its k-th
    and next score: inf for the hash layer) as the reference forward routes."""
    fam, layer, k = art.cfg.family, call["layer"], art.cfg.num_experts_per_tok
    scores = F.softplus(call["x"].float() @ weights[fam.tensor("router", layer)].float().T).sqrt()
    margin = torch.full(scores.shape[:1], float("inf"))
    if art.cfg.mlp[layer] == "hash":
        ids = weights[fam.tensor("hash_table", layer)].long()[call["tokens"].long()]
    else:
        biased = scores + weights[fam.tensor("router_bias", layer)].float()
        ids = torch.topk(biased, k, dim=-1).indices
        top = biased.topk(k + 1, dim=-1).values
        margin = top[:, k - 1] - top[:, k]
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * art.cfg.raw["routed_scaling_factor"]
    return ids, torch.zeros_like(scores).scatter(1, ids, w), margin


def test_vllms_routing_reaches_the_pool_as_the_familys(hybrid: dict) -> None:
    """Each captured pool call: vLLM's expert ids are the family's (layer 0 by the token→expert
    table, exactly; a top-k layer's set equal but where two scores are within WEIGHT_TOL), its
    weights within WEIGHT_TOL (routed scaling included), and the method's output is exactly the
    pool's with the clip — which changes it."""
    art = open_artifact(hybrid["art"])
    weights, pool = art.load(ParallelLayout(tp_size=1, tp_rank=0)), art.cpu_expert_pool()
    kinds, rows, ties = set(), 0, 0
    for call in hybrid["calls"]:
        ids, dense, margin = _family_routing(art, weights, call)
        kinds.add(art.cfg.mlp[call["layer"]])
        theirs = call["topk_ids"].long()
        same = (ids.sort(-1).values == theirs.sort(-1).values).all(-1)
        assert bool((margin[~same] < WEIGHT_TOL).all()), (call["layer"], margin[~same])
        rows, ties = rows + len(same), ties + int((~same).sum())
        vllm_dense = torch.zeros_like(dense).scatter(1, theirs, call["topk_weights"].float())
        assert float((vllm_dense - dense)[same].abs().max()) <= WEIGHT_TOL
        args = (call["layer"], call["x"], call["topk_ids"], call["topk_weights"])
        assert torch.equal(pool.forward(*args, limit=LIMIT), call["out"])
        assert not torch.equal(pool.forward(*args), call["out"])  # the clip acts
    assert kinds == {"hash", "topk"}
    print(
        f"\nvLLM's routing against the family's: {rows - ties} of {rows} rows the same experts "
        f"(the rest near-ties, margin < {WEIGHT_TOL})"
    )
    assert ties <= rows // 100


def test_hybrid_within_bf16_distance_of_hetquant_run(hybrid: dict, record_property) -> None:
    """Teacher-forced on vLLM's greedy tokens (``test_vllm_deepseek_v4.py``'s property): every
    token's logprob within TF_TOL of ``hetquant run --kv-cache fp8_ds_mla`` of the same hybrid
    artifact, closer on average than without the emulation; argmax agreement printed."""
    check_teacher_forced(hybrid["art"], hybrid["got"], "V4 hybrid + plugin", record_property)
