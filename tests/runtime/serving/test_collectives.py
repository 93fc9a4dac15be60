"""The run's collective backend: which one each device gets, the refusals, and where tensors
live when ranks exchange them (no host copies under a device-native backend).

Availability is monkeypatched (CI has no GPU and no Ascend). The rank's device is stood in for
by "meta" (shapes, no data): a copy of its tensors to the host raises, whatever API made it
(``.cpu()``, ``.to("cpu")``, ``copy_``), and every op that crosses host <-> device is recorded.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hetquant.formats import HetquantError
from hetquant.runtime.serving import collectives
from hetquant.runtime.serving.collectives import (
    BACKENDS,
    Comm,
    choose_backend,
    init_groups,
    rank_device,
)
from hetquant.runtime.serving.pipeline import StagePlace, generate, stage_step
from hetquant.runtime.serving.run import RunSpec, run_artifact

TOKENS = (5, 17, 42, 100)


# availability ---------------------------------------------------------------------------------
def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, nccl: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)


def _torch_npu(monkeypatch: pytest.MonkeyPatch, count: int, hccl: bool = True) -> list[int]:
    """A stand-in for torch_npu: importable, ``torch.npu`` with ``count`` devices; returns the
    list that ``torch.npu.set_device`` appends to."""
    current: list[int] = []
    npu = types.SimpleNamespace(device_count=lambda: count, set_device=current.append)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(dist, "is_hccl_available", lambda: hccl, raising=False)
    return current


def _refusal(device: str, requested: str | None, world: int) -> str:
    with pytest.raises(HetquantError) as e:
        choose_backend(device, requested, world)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# selection ------------------------------------------------------------------------------------
def test_each_device_gets_its_own_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    _torch_npu(monkeypatch, 2)
    assert choose_backend("cpu", None, 4).name == "gloo"
    assert choose_backend("cuda", None, 2).name == "nccl"
    assert choose_backend("npu", None, 2).name == "hccl"
    assert [BACKENDS[n].native for n in ("gloo", "nccl", "hccl")] == [False, True, True]


def test_gloo_can_be_asked_for_on_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    for device in ("cpu", "cuda", "npu"):
        assert choose_backend(device, "gloo", 4).name == "gloo"  # ranks may share a device


def test_one_rank_makes_no_process_group_unless_a_backend_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _gpus(monkeypatch, 1)
    assert RunSpec("a", TOKENS).collective_backend() is None
    assert RunSpec("a", TOKENS, device="cuda").collective_backend() is None
    named = RunSpec("a", TOKENS, device="cuda", dist_backend="nccl").collective_backend()
    assert named is not None and named.name == "nccl"
    tp2 = RunSpec("a", TOKENS, tp=2).collective_backend()
    assert tp2 is not None and tp2.name == "gloo"


# refusals -------------------------------------------------------------------------------------
def test_nccl_refusals_name_the_gloo_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    msg = _refusal("cuda", None, 2)
    assert msg.startswith("--dist-backend nccl (the default for --device cuda): torch ")
    assert "sees no CUDA device" in msg and msg.endswith(
        "use --dist-backend gloo (dist_backend='gloo': collectives through host copies)"
    )
    _gpus(monkeypatch, 2, nccl=False)
    assert "built without NCCL" in _refusal("cuda", "nccl", 2)
    _gpus(monkeypatch, 2)
    msg = _refusal("cuda", "nccl", 3)
    assert "3 ranks need 3 cuda devices, one each; 2 visible" in msg and "gloo" in msg


def test_hccl_refusals_name_the_gloo_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    msg = _refusal("npu", None, 2)
    assert msg.startswith("--dist-backend hccl (the default for --device npu): it needs torch_npu")
    assert msg.endswith(
        "use --dist-backend gloo (dist_backend='gloo': collectives through host copies)"
    )
    _torch_npu(monkeypatch, 2, hccl=False)
    assert "is_hccl_available() is False" in _refusal("npu", "hccl", 2)
    _torch_npu(monkeypatch, 1)
    assert "2 ranks need 2 npu devices, one each; 1 visible" in _refusal("npu", "hccl", 2)


def test_backend_and_device_mismatch_and_unknown_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    msg = _refusal("cpu", "nccl", 2)
    assert "take cuda tensors, not --device cpu's; use --dist-backend gloo" in msg
    assert "use --dist-backend nccl" in _refusal("cuda", "hccl", 2)
    assert (
        _refusal("cpu", "mpi", 2) == "--dist-backend mpi: unknown backend; known: gloo, hccl, nccl"
    )
    assert _refusal("xpu", None, 2) == "--device xpu: unknown; known: cpu, cuda, npu"
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    assert "built without gloo; run one rank" in _refusal("cpu", None, 2)


def test_cli_refuses_before_spawning(
    cli, tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, 0)
    res = cli("run", tiny_artifact, "--tokens", "5,17", "--tp", "2", "--device", "cuda")
    assert res.exit_code == 2
    assert res.stderr.startswith("error: --dist-backend nccl (the default for --device cuda)")
    assert res.stderr.strip().endswith(
        "use --dist-backend gloo (dist_backend='gloo': collectives through host copies)"
    )
    assert len(res.stderr.strip().splitlines()) == 1
    res = cli("run", tiny_artifact, "--tokens", "5", "--dist-backend", "nccl")
    assert res.exit_code == 2 and "not --device cpu's" in res.stderr


# gloo on the CPU ------------------------------------------------------------------------------
def test_named_gloo_equals_the_default_bit_for_bit(tiny_artifact: Path) -> None:
    """tp 2 on the CPU: the default is gloo; a one-rank gloo group (world 1, named) runs every
    collective through gloo and changes no bit either."""
    single, gen1 = run_artifact(RunSpec(str(tiny_artifact), TOKENS, generate=1))
    one_rank, gen2 = run_artifact(
        RunSpec(str(tiny_artifact), TOKENS, generate=1, dist_backend="gloo")
    )
    tp2, gen3 = run_artifact(RunSpec(str(tiny_artifact), TOKENS, tp=2, generate=1))
    timings: list[dict[str, Any]] = []
    tp2_named, gen4 = run_artifact(
        RunSpec(str(tiny_artifact), TOKENS, tp=2, generate=1, dist_backend="gloo"), timings=timings
    )
    assert np.array_equal(single, one_rank) and gen1 == gen2
    assert np.array_equal(tp2, tp2_named) and gen3 == gen4
    assert [(t["rank"], t["backend"], t["device"]) for t in timings] == [
        (0, "gloo", "cpu"),
        (1, "gloo", "cpu"),
    ]
    assert all(len(t["steps_s"]) == 2 and t["load_s"] > 0 for t in timings)


# where exchanged tensors live -----------------------------------------------------------------
# The rank's device is "meta" here: tensors with shapes and no data, so any copy to the host
# raises, and every op that crosses host <-> device is recorded as well.
DEV = torch.device("meta")


class _Transfers(TorchDispatchMode):
    """Every op that moves data between the host and a device: ``h2d``, ``d2h``."""

    def __init__(self) -> None:
        super().__init__()
        self.d2h: list[str] = []
        self.h2d: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        ins = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outs = {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        if ins - {"cpu"} and "cpu" in outs:
            self.d2h.append(str(func))
        if "cpu" in ins and outs - {"cpu"}:
            self.h2d.append(str(func))
        return out


def _fake_dist(monkeypatch: pytest.MonkeyPatch, backend: str) -> list[tuple[str, str]]:
    """torch.distributed's calls replaced by recorders of (call, device type of its tensor)."""
    calls: list[tuple[str, str]] = []

    def record(name: str) -> Any:
        def call(x: Any, *args: Any, **kwargs: Any) -> None:
            t = args[0] if name == "all_gather" else x  # all_gather(parts, x)
            calls.append((name, t.device.type))

        return call

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    for name in ("all_reduce", "all_gather", "send", "recv", "broadcast"):
        monkeypatch.setattr(dist, name, record(name))
    return calls


def test_comm_under_a_native_backend_leaves_tensors_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _fake_dist(monkeypatch, "nccl")
    comm = Comm(group=object(), size=2, rank=0)
    with _Transfers() as moved:
        x = torch.ones(3, 8, device=DEV)  # [T, D], on the rank's device
        assert comm.all_reduce(x) is x
        y = comm.all_gather_last(x)  # [T, 2·D]
    assert y.shape == (3, 16) and y.device == DEV
    assert calls == [("all_reduce", "meta"), ("all_gather", "meta")]
    assert moved.d2h == [] and moved.h2d == []


def test_comm_under_gloo_goes_through_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same set-up sees gloo's host copies (they raise on meta tensors); host tensors go
    to gloo as given, the same objects."""
    calls = _fake_dist(monkeypatch, "gloo")
    comm = Comm(group=object(), size=2, rank=0)
    for op in (comm.all_reduce, comm.all_gather_last):
        with pytest.raises(NotImplementedError, match="meta"):
            op(torch.ones(3, 8, device=DEV))
    x = torch.ones(3, 8)
    with _Transfers() as moved:
        assert comm.all_reduce(x) is x
    assert calls == [("all_reduce", "cpu")] and moved.d2h == moved.h2d == []


def _stage_model(monkeypatch: pytest.MonkeyPatch) -> Any:
    from hetquant.runtime.serving import rank as rank_module

    def run_stage(
        model: Any, layers: range, x: torch.Tensor, *, first: bool, last: bool, tokens: Any
    ) -> Any:
        x = x.to(model.weights.device)  # as the real run_stage
        return torch.ones(x.shape[0], 32 if last else 8, device=x.device)  # logits / hidden

    monkeypatch.setattr(rank_module, "run_stage", run_stage)
    cfg = types.SimpleNamespace(hidden_size=8)
    return types.SimpleNamespace(
        cfg=cfg, dtype=torch.float32, weights=types.SimpleNamespace(device=DEV),
        hidden_shape=lambda t: (t, cfg.hidden_size),
    )  # fmt: skip


def test_stages_hand_tensors_over_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a native backend a middle stage receives and sends hidden states on its device,
    and the last stage's group rank 0 generates there, broadcasting each next token: nothing
    reaches the host; the token ids come from it once, at the start."""
    calls = _fake_dist(monkeypatch, "nccl")
    model = _stage_model(monkeypatch)
    link = collectives.wire(None, DEV)
    with _Transfers() as moved:
        h = torch.zeros(4, 8, device=DEV)  # [T, D]
        assert stage_step(model, range(1), h, StagePlace(1, 3, 0, 2), link) is None
        mid = list(calls)
        logits, seq, steps = generate(
            model, range(2), TOKENS, 2, StagePlace(1, 2, 0, 2), link, True
        )
    assert link == DEV and mid == [("recv", "meta"), ("send", "meta")]
    assert calls[2:] == [("recv", "meta"), ("broadcast", "meta")] * 2 + [("recv", "meta")]
    assert logits is not None and logits.shape == (4, 32) and logits.device == DEV
    assert seq.shape == (6,) and seq.device == DEV and len(steps) == 3
    assert moved.d2h == [] and moved.h2d == ["aten._to_copy.default"]  # the token ids


def test_stages_under_gloo_hand_host_tensors_over(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_dist(monkeypatch, "gloo")
    model = _stage_model(monkeypatch)
    link = collectives.wire(None, DEV)
    h = torch.zeros(4, 8)  # [T, D] received on the host
    with pytest.raises(NotImplementedError, match="meta"):  # the send's host copy
        stage_step(model, range(1), h, StagePlace(1, 3, 0, 2), link)
    assert link == torch.device("cpu") and calls == [("recv", "cpu")]


def test_ranks_bind_their_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl: rank r on cuda:r; gloo: cuda:{group rank % GPUs}, as before; hccl: npu:r made
    current, tensors on the host (the npu kernels hand them over)."""
    _gpus(monkeypatch, 2)
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    nccl, gloo = BACKENDS["nccl"], BACKENDS["gloo"]
    assert rank_device("cuda", 1, 0, nccl) == torch.device("cuda", 1)  # pp 2: stage 1
    assert rank_device("cuda", 3, 1, gloo) == torch.device("cuda", 1)
    assert rank_device("cuda", 2, 0, None) == torch.device("cuda", 0)
    assert current == [1, 1, 0]
    assert rank_device("cpu", 1, 1, gloo) == torch.device("cpu")
    npu_current = _torch_npu(monkeypatch, 2)
    assert rank_device("npu", 1, 1, BACKENDS["hccl"]) == torch.device("cpu")
    assert npu_current == ["npu:1"] and current == [1, 1, 0]


@pytest.mark.parametrize(
    ("name", "stages", "size", "grouped"),
    [("nccl", 1, 2, True), ("nccl", 2, 1, False), ("nccl", 1, 1, True), ("gloo", 2, 2, True)],
)
def test_process_groups(
    monkeypatch: pytest.MonkeyPatch, name: str, stages: int, size: int, grouped: bool
) -> None:
    """One group per stage; a stage of one rank among several gets none (as before), a run of
    one rank alone gets its one-rank group; nccl is bound to the rank's GPU at init."""
    made: list[Any] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: made.append((a, k)))
    monkeypatch.setattr(dist, "new_group", lambda ranks: tuple(ranks))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    rank = stages * size - 1
    device = torch.device("cuda", rank) if name == "nccl" else torch.device("cpu")
    comm, link = init_groups(BACKENDS[name], dist.HashStore(), rank, stages, size, device)
    (args, kwargs) = made[0]
    assert args == (name,) and kwargs["world_size"] == stages * size and kwargs["rank"] == rank
    assert kwargs.get("device_id") == (device if name == "nccl" else None)
    assert comm.group == (tuple(range((stages - 1) * size, stages * size)) if grouped else None)
    assert (comm.size, comm.rank) == ((size, size - 1) if grouped else (1, 0))
    assert link == (device if name == "nccl" else torch.device("cpu"))
