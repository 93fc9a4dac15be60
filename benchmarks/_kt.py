"""kt-kernel next to hetquant in one process: synthetic CPU-expert artifacts, their kt exports,
kt-kernel's MoE driven directly, and an exact float64 reference (for ``kt_check.py`` and
``bench_kt_side_by_side.py``).

Runs in kt-kernel's own environment (it pins torch 2.9.1; 0.7.2's extension does not link
libtorch, so another torch works — the GPU host has 2.11), never in hetquant's venv. hetquant is
imported from this checkout when it is not installed there (:func:`import_hetquant`).

kt-kernel is driven through its extension (``kt_kernel_ext``: ``CPUInfer`` + ``MOEConfig`` + the
method's MoE class, ``load_weights_task`` / ``forward_task``), as its wrappers do
(``kt_kernel/utils/amx.py`` ``AMXMoEWrapper.load_weights``, ``NativeMoEWrapper.load_weights``),
without their pinned buffers (which need a GPU): AMXINT4 reads the ``.kt`` tree of
``hetquant export --to kt-amxint4`` (``moe_config.path``, ``load = True``), RAWINT4 the
safetensors of ``--to kt-rawint4`` through kt's own ``CompressedSafeTensorLoader``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
LAYER = 3  # the synthetic artifact's one MoE layer
KEYS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


def import_hetquant() -> None:
    """Make ``hetquant.*`` importable from this checkout (its folders are the subpackages)."""
    try:
        import hetquant.formats  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("hetquant")
        pkg.__path__ = [str(REPO)]  # hetquant.formats → REPO/formats, ... (pyproject package-dir)
        sys.modules["hetquant"] = pkg


def make_hybrid(root: Path, experts: int, hidden: int, inter: int, group: int, seed: int) -> Path:
    """A minimal hybrid artifact: config.json (DeepSeek-V3's, the dims replaced), one
    ``cpu_experts`` layer of random codes (1..15) and scales — per-channel F32 (``group`` 0) or
    BF16 per ``group`` inputs — written expert by expert (no whole-layer tensors in memory)."""
    import_hetquant()
    from hetquant.formats.int4_cpu import layer_stored
    from hetquant.formats.int4_cpu_group import layer_stored as group_stored
    from hetquant.formats.safetensors_io import build_header

    art = root / f"hybrid-e{experts}-h{hidden}-i{inter}-g{group}-s{seed}"
    if (art / "hetquant.json").exists():
        return art
    f = art / "cpu_experts" / f"layer_{LAYER:03d}.safetensors"
    f.parent.mkdir(parents=True, exist_ok=True)
    metas = group_stored(experts, hidden, inter, group) if group else layer_stored(experts, hidden, inter)  # fmt: skip
    named = [(f"model.layers.{LAYER}.mlp.experts.{k}", m) for k, m in metas.items()]
    header = build_header(named, {"format": "pt"})
    rng = np.random.default_rng(seed)
    with open(f, "wb") as fh:
        fh.write(header)
        for _, meta in named:
            per = meta.nbytes // experts
            for _ in range(experts):
                fh.write(_random_bytes(rng, meta.dtype, per))
    cfg = json.loads((REPO / "examples" / "deepseek-v3-layout" / "config.json").read_text())
    cfg.update(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
    # LAYER is the one MoE layer; the layers before it dense, no MTP layer, a small vocabulary
    cfg.update(num_hidden_layers=LAYER + 1, first_k_dense_replace=LAYER, vocab_size=1024)
    cfg.update(num_nextn_predict_layers=0)
    cfg.pop("quantization_config", None)
    (art / "config.json").write_text(json.dumps(cfg, indent=2))
    root = write_sparse_root(art)
    write_manifest(art, {"root": root, "cpu_experts": [f.relative_to(art).as_posix()]})
    return art


def write_sparse_root(art: Path) -> list[str]:
    """The root part config.json implies (every tensor but the routed experts, BF16), written as
    one safetensors file whose data are sparse holes (zeros), and its index: what ``open_artifact``
    (and so ``hetquant export``) checks the artifact against; nothing here reads its data."""
    from hetquant.formats.base import TensorMeta
    from hetquant.formats.families import expected_tensors, load_config
    from hetquant.formats.safetensors_io import build_header

    roles = expected_tensors(load_config(art / "config.json"))
    named = [(n, TensorMeta("BF16", tuple(r.shape))) for n, r in roles.items() if r.stack is None]
    name = "model-00001-of-00001.safetensors"
    header = build_header(named, {"format": "pt"})
    size = sum(2 * math.prod(m.shape) for _, m in named)
    with open(art / name, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + size)
    index = {"metadata": {"total_size": size}, "weight_map": {n: name for n, _ in named}}
    (art / "model.safetensors.index.json").write_text(json.dumps(index))
    return [name, "model.safetensors.index.json"]


def write_manifest(art: Path, parts: dict[str, list[str]]) -> None:
    """A ``hetquant.json`` that passes the manifest schema (``formats/manifest_schema.py``) for a
    synthetic artifact: recipe ``synthetic``, no source, every file's size and sha256; written
    last, as the converter does."""
    import hashlib

    files = {}
    parts = {k: [*v, "config.json"] if k == "root" else v for k, v in parts.items()}
    for rel in sorted({r for rels in parts.values() for r in [*rels, "config.json"]}):
        path, digest = art / rel, hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
        files[rel] = {"size": path.stat().st_size, "sha256": digest.hexdigest()}
    manifest = {
        "schema_version": 2,
        "complete": True,
        "recipe": {"name": "synthetic", "options": {}},
        "source": {"path": "synthetic", "fingerprint": "synthetic", "dtypes": {}},
        "max_shard_size": 0,
        "precision": {"groups": [], "params": 0, "bytes": 0, "effective_bits_per_weight": 0.0},
        "parts": {name: {"files": rels} for name, rels in parts.items()},
        "files": files,
    }
    (art / "hetquant.json").write_text(json.dumps(manifest, indent=1))


def _random_bytes(rng: np.random.Generator, dtype: str, nbytes: int) -> bytes:
    if dtype == "U8":  # two codes in 1..15 per byte
        r = rng.integers(0, 225, nbytes, dtype=np.uint8)
        return ((1 + r % 15) | ((1 + r // 15) << 4)).astype(np.uint8).tobytes()
    s = rng.uniform(2e-3, 6e-3, nbytes // (4 if dtype == "F32" else 2)).astype(np.float32)
    t = torch.from_numpy(s)
    return (t if dtype == "F32" else t.to(torch.bfloat16)).view(torch.uint8).numpy().tobytes()


def export(art: Path, to: str, numa: int) -> Path:
    """``hetquant export ART OUT --to TO --numa NUMA`` (kept beside the artifact)."""
    import_hetquant()
    from hetquant.convert.export import export as run_export

    out = art.parent / f"{art.name}-{to}-numa{numa}"
    run_export(art, out, to, numa=numa)
    return out


def _numa_nodes() -> int:
    nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*")]
    return max(1, len(nodes))


class KtMoE:
    """One MoE layer in kt-kernel (module docstring); ``forward`` is synchronous."""

    def __init__(self, path: Path, method: str, experts: int, topk: int, hidden: int,
                 inter: int, threads: int, numa: int, max_len: int = 128) -> None:  # fmt: skip
        import kt_kernel
        from kt_kernel.utils import amx as ktamx

        ext = kt_kernel.kt_kernel_ext
        self.variant = kt_kernel.__cpu_variant__
        cfg = ext.WorkerPoolConfig()
        cfg.subpool_count = numa
        cfg.subpool_numa_map = [s % _numa_nodes() for s in range(numa)]
        cfg.subpool_thread_count = [threads // numa + (s < threads % numa) for s in range(numa)]
        self.cpu = ext.CPUInfer(cfg)
        self.topk, self.hidden = topk, hidden
        self._keep: list[Any] = [torch.zeros(experts, dtype=torch.bool)]  # gpu_experts_mask
        mc = ext.moe.MOEConfig(experts, topk, hidden, inter, self._keep[0].data_ptr())
        mc.layer_idx, mc.pool, mc.max_len = LAYER, self.cpu.backend_, max_len
        if method == "AMXINT4":
            if ktamx.AMXInt4_MOE is None:
                raise RuntimeError(f"kt-kernel variant {self.variant!r} has no AMXInt4_MOE (AVX-512 needed)")  # fmt: skip
            mc.path, mc.load = str(path), True
            cls = ktamx.AMXInt4_MOE
        else:
            w = ktamx.CompressedSafeTensorLoader(str(path)).load_experts(f"model.layers.{LAYER}")
            self._keep.append(w)
            for proj in ("gate", "up", "down"):
                setattr(mc, f"{proj}_projs", [[t.data_ptr() for t in w[proj]]])
                setattr(mc, f"{proj}_scales", [[t.data_ptr() for t in w[f"{proj}_scale"]]])
            group = hidden // w["gate_scale"][0].shape[1]
            mc.quant_config.bits, mc.quant_config.group_size = 4, group
            mc.quant_config.zero_point = False
            cls = ktamx._select_rawint4_backend(group)
        self.backend = cls.__name__
        self.moe = cls(mc)
        phys = torch.arange(experts, dtype=torch.int64)
        self.cpu.submit(self.moe.load_weights_task(phys.data_ptr()))
        self.cpu.sync()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x bf16 [T, H], ids [T, k], weights [T, k] → bf16 [T, H]."""
        x = x.to(torch.bfloat16).contiguous()
        ids = ids.to(torch.int64).contiguous()
        w = w.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        bsz = torch.tensor([x.shape[0]], dtype=torch.int32)
        task = self.moe.forward_task(bsz.data_ptr(), self.topk, ids.data_ptr(), w.data_ptr(),
                                     x.data_ptr(), out.data_ptr(), False)  # fmt: skip
        self.cpu.submit(task)
        self.cpu.sync()
        return out


def reference(art: Path, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``Σ_k w_k · down(silu(gate x) ⊙ up x)`` over the exactly dequantized experts."""
    import_hetquant()
    from safetensors import safe_open

    from hetquant.formats import int4_cpu, int4_cpu_group

    f = art / "cpu_experts" / f"layer_{LAYER:03d}.safetensors"
    out = torch.zeros(x.shape, dtype=torch.float64)
    x64 = x.to(torch.float64)
    with safe_open(str(f), "pt") as st:
        layer = {k: st.get_slice(f"model.layers.{LAYER}.mlp.experts.{k}") for k in KEYS}
        group = layer["gate_up_scale"].get_shape().__len__() == 3
        mod = int4_cpu_group if group else int4_cpu
        for e in sorted(set(ids.flatten().tolist())):
            one = {k: v[e : e + 1] for k, v in layer.items()}
            g, u, d = (m.to(torch.float64) for m in mod.dequantize_expert(one, 0))
            t, slot = (ids == e).nonzero(as_tuple=True)
            act = torch.nn.functional.silu(x64[t] @ g.T) * (x64[t] @ u.T)
            out.index_add_(0, t, (act @ d.T) * w[t, slot].to(torch.float64)[:, None])
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``‖y − ref‖ / ‖ref‖`` (float64)."""
    return float((y.to(torch.float64) - ref).norm() / ref.norm())


def routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def environment() -> dict[str, Any]:
    import kt_kernel

    return {
        "kt_kernel": getattr(kt_kernel, "__version__", "?"),
        "kt_variant": kt_kernel.__cpu_variant__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "KT_RAWINT4_BACKEND": os.environ.get("KT_RAWINT4_BACKEND"),
    }
