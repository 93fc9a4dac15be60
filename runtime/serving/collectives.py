"""Which torch.distributed backend a run's ranks use, and one process group's collectives.

The backend is the device's own unless one is named (``RunSpec.dist_backend``,
``hetquant run --dist-backend``):

| ``--device`` | backend | its collectives take | a rank's device |
|---|---|---|---|
| cpu | gloo | host tensors | the host |
| cuda | nccl | CUDA tensors | ``cuda:{local rank}``, one GPU per rank |
| npu | hccl | NPU tensors | ``npu:{local rank}``, one NPU per rank |

gloo serves every device: on accelerator tensors its collectives go through host copies, and
ranks may share a device — the fallback where the device's own backend is missing. A backend that
cannot run here is refused before any rank starts, with one line naming the fallback.

hccl is torch_npu's: importing torch_npu registers it
(``torch.distributed.Backend.register_backend("hccl", …, devices=["npu"])``) and sets
``torch.distributed.is_hccl_available`` (Ascend/pytorch ``torch_npu/__init__.py``:144-151 at
0036ada); its documented use is ``torch.npu.set_device(f"npu:{rank}")`` then
``dist.init_process_group("hccl", rank=rank, world_size=world_size)`` (Ascend op-plugin docs,
``docs/context/torch-distributed-distributed_c10d.md``, 7.3.0, the ``get_hccl_comm_name``
example; hiascend.com API list "(beta)torch.distributed.is_hccl_available"). Not run here: no
Ascend hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from hetquant.formats import HetquantError

__all__ = [
    "BACKENDS",
    "DEVICE_BACKENDS",
    "CollectiveBackend",
    "Comm",
    "choose_backend",
    "init_groups",
    "join_store",
    "rank_device",
    "rendezvous",
    "wire",
]


@dataclass(frozen=True)
class CollectiveBackend:
    """One torch.distributed backend: the ``--device`` values it serves, the device type whose
    tensors its collectives take (``wire``; "cpu": host copies for accelerator tensors), why it
    cannot run here (``missing(world)``, None when it can) and what to ask for instead."""

    name: str
    devices: tuple[str, ...]
    wire: str
    missing: Callable[[int], str | None]
    fallback: str

    @property
    def native(self) -> bool:
        """Its collectives take device tensors: no host copies, one device per rank."""
        return self.wire != "cpu"


def _gloo_missing(world: int) -> str | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        return f"torch {torch.__version__} is built without gloo"
    return None


def _nccl_missing(world: int) -> str | None:
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    if not (dist.is_available() and dist.is_nccl_available()):
        return f"torch {torch.__version__} is built without NCCL (is_nccl_available() is False)"
    return _one_device_per_rank("cuda", torch.cuda.device_count(), world)


def _hccl_missing(world: int) -> str | None:
    try:
        import torch_npu  # noqa: F401  (registers "hccl" and torch.npu)
    except (ImportError, OSError, RuntimeError) as exc:
        why = " ".join(str(exc).split())  # one line
        return f"it needs torch_npu on an Ascend host ({type(exc).__name__}: {why})"
    import torch.distributed as dist

    if not getattr(dist, "is_hccl_available", lambda: False)():
        return "torch_npu is imported but torch.distributed.is_hccl_available() is False"
    return _one_device_per_rank("npu", torch.npu.device_count(), world)  # type: ignore[attr-defined]


def _one_device_per_rank(kind: str, count: int, world: int) -> str | None:
    if world > count:
        return f"{world} ranks need {world} {kind} devices, one each; {count} visible"
    return None


_HOST = "127.0.0.1"  # every rank runs on this host
_JOINED = "hetquant/joined/"  # store key of a rank that has joined, + its rank
_TO_GLOO = "use --dist-backend gloo (dist_backend='gloo': collectives through host copies)"
BACKENDS: dict[str, CollectiveBackend] = {
    b.name: b
    for b in (
        CollectiveBackend("gloo", ("cpu", "cuda", "npu"), "cpu", _gloo_missing, "run one rank"),
        CollectiveBackend("nccl", ("cuda",), "cuda", _nccl_missing, _TO_GLOO),
        CollectiveBackend("hccl", ("npu",), "npu", _hccl_missing, _TO_GLOO),
    )
}
"""backend name → ``CollectiveBackend``."""

DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""``--device`` → its own backend, the default."""


def choose_backend(device: str, requested: str | None, world: int) -> CollectiveBackend:
    """The backend for ``world`` ranks on ``device``: ``requested``, else the device's own.

    Raises HetquantError (one line, naming what to ask for instead) for an unknown name, a
    backend that does not serve ``device``, or one that cannot run here (``missing``).
    """
    if device not in DEVICE_BACKENDS:
        raise HetquantError(f"--device {device}: unknown; known: {', '.join(DEVICE_BACKENDS)}")
    name = requested or DEVICE_BACKENDS[device]
    how = f"--dist-backend {name}" + ("" if requested else f" (the default for --device {device})")
    be = BACKENDS.get(name)
    if be is None:
        raise HetquantError(f"{how}: unknown backend; known: {', '.join(sorted(BACKENDS))}")
    if device not in be.devices:
        own = DEVICE_BACKENDS[device]
        raise HetquantError(
            f"{how}: its collectives take {be.wire} tensors, not --device {device}'s; "
            f"use --dist-backend {own} (or leave it out)"
        )
    why = be.missing(world)
    if why is not None:
        raise HetquantError(f"{how}: {why}; {be.fallback}")
    return be


class Comm:
    """Collectives over one process group; without a group, a single rank (identity).

    A backend whose ``wire`` is the host (gloo) gets accelerator tensors through host copies;
    a device-native one (nccl, hccl) gets them where they are. ``size``/``rank``: the group's.
    """

    def __init__(self, group: Any = None, size: int = 1, rank: int = 0) -> None:
        self.group, self.size, self.rank = group, size, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``x``, in place (same shapes)."""
        if self.group is None:
            return x
        import torch.distributed as dist

        if self._via_host(x):
            x.copy_(self.all_reduce(x.cpu()))
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim (equal shapes)."""
        if self.group is None:
            return x
        import torch.distributed as dist

        if self._via_host(x):
            return self.all_gather_last(x.cpu()).to(x.device)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def _via_host(self, x: torch.Tensor) -> bool:
        """An accelerator tensor on a backend whose collectives take host tensors (gloo)."""
        return x.device.type != "cpu" and wire(self.group).type == "cpu"


def wire(group: Any = None, device: torch.device | None = None) -> torch.device:
    """Where tensors crossing ``group``'s backend live: the rank's ``device`` (or just the
    backend's device type, when None) for a device-native backend; the host for gloo and for
    backends not in ``BACKENDS``."""
    import torch.distributed as dist

    be = BACKENDS.get(str(dist.get_backend(group)))
    if be is None or not be.native:
        return torch.device("cpu")
    return device if device is not None else torch.device(be.wire)


def rank_device(
    device: str, rank: int, grank: int, backend: CollectiveBackend | None
) -> torch.device:
    """Where rank ``rank`` (group rank ``grank``) of a run on ``device`` loads its tensors, made
    the current device. A device-native backend takes one device per rank, device ``rank``
    (every rank is on this host: the local rank is the rank): ``cuda:{rank}``; under hccl,
    ``npu:{rank}`` is made current as torch_npu documents and the tensors load to the host (the
    npu kernels' repack hands them to torch_npu). gloo on cuda: ``cuda:{grank % GPUs}`` (ranks
    may share a GPU)."""
    native = backend is not None and backend.native
    if device == "cuda":
        if not torch.cuda.is_available():
            raise HetquantError("--device cuda: no CUDA device here; use --device cpu")
        index = rank if native else grank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if backend is not None and native:
        getattr(torch, backend.wire).set_device(f"{backend.wire}:{rank}")  # torch.npu: "npu:{rank}"
    return torch.device("cpu")


def rendezvous(timeout_s: float) -> Any:
    """Where a run's ranks meet: a TCP store served by this (the parent) process on a port the
    OS picks — no free port to guess, none another process can take before a rank binds it —
    alive as long as the returned store; ``.port`` tells the ranks where it is."""
    import torch.distributed as dist

    wait = timedelta(seconds=timeout_s)
    return dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=wait)


def join_store(port: int, timeout_s: float, rank: int, world: int) -> Any:
    """Rank ``rank``'s connection to ``rendezvous``'s store, once all ``world`` ranks have
    connected: a rank that never comes (it died or hangs before joining) or a store that is not
    there ends in one ``HetquantError`` line after ``timeout_s``, not torch's 30 minutes."""
    import torch.distributed as dist

    wait = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=wait)
        store.set(f"{_JOINED}{rank}", "1")
    except (RuntimeError, ValueError) as e:  # torch's DistError family
        raise HetquantError(f"run: rank {rank} of {world} cannot reach the ranks' store on {_HOST}:{port}: {_line(e)}") from None  # fmt: skip
    try:
        store.wait([f"{_JOINED}{r}" for r in range(world)])
    except (RuntimeError, ValueError):
        late = [r for r in range(world) if not store.check([f"{_JOINED}{r}"])]
        raise HetquantError(
            f"run: rank {rank} of {world}: rank(s) {late} did not join within {timeout_s:g} s "
            "(did one die or hang on its way?)"
        ) from None
    return store


def init_groups(
    backend: CollectiveBackend,
    store: Any,
    rank: int,
    stages: int,
    size: int,
    device: torch.device,
) -> tuple[Comm, torch.device]:
    """The world's process group (``stages × size`` ranks, rendezvous through ``store``, see
    ``join_store``) and one group per stage over ``backend``. Returns rank ``rank``'s stage
    ``Comm`` and where tensors crossing ranks live (``wire``: ``device`` for a device-native
    backend, else the host). A stage of one rank among several gets no collectives; a run of
    one rank alone runs them through its one-rank group, so the backend it named is the one
    exercised. torch's refusals (a backend's own failure to connect) are one ``HetquantError``
    line."""
    import torch.distributed as dist

    world = stages * size
    bind = {"device_id": device} if backend.native and device.type == backend.wire else {}
    try:
        dist.init_process_group(backend.name, store=store, rank=rank, world_size=world, **bind)
        groups = [dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(stages)]
    except (RuntimeError, ValueError) as e:  # torch's DistError family: a timeout, a refusal
        raise HetquantError(
            f"run: rank {rank} of {world} could not join the {backend.name} process group: "
            f"{_line(e)}"
        ) from None
    stage, grank = divmod(rank, size)
    comm = Comm(groups[stage], size, grank) if size > 1 or world == 1 else Comm()
    return comm, wire(None, device)


def _line(e: BaseException) -> str:
    """The first line of ``e``'s message, at most 200 characters."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
