"""Artifact loading: every recipe of the tiny model under TP, PP, EP (redundant experts), attn-DP.

For each legal layout, the ranks' tensors put back together (dequantized and concatenated along
the split dim, whole experts gathered) equal the unsharded load exactly; each rank reads exactly
the bytes it keeps, and about its share. The expected split of every module comes from the
``SPLIT`` table here, not from the loader's rules.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support import TINY, as_older_schema, run_cli

from hetquant.formats import HetquantError
from hetquant.formats.nvfp4_ascend import tiled_slice
from hetquant.runtime import ParallelLayout, open_artifact
from hetquant.runtime.loading import _reader
from hetquant.runtime.loading._reader import Span
from hetquant.runtime.loading.loader import Artifact

PL = ParallelLayout
ARTIFACTS = {  # name → convert options (bf16 keeps the MTP layer; the others drop it: faster)
    "bf16": ("--recipe", "bf16"),
    "hybrid": ("--recipe", "ascend-hybrid", "--mtp", "drop"),
    "w8a8": ("--recipe", "ascend-w8a8", "--mtp", "drop"),
    "awq": ("--recipe", "awq-w4a16", "--mtp", "drop"),
    "fp4": ("--recipe", "fp4", "--mtp", "drop"),
    "nvfp4": ("--recipe", "fp4", "--fp4-layout", "nvfp4", "--mtp", "drop"),
    "w4a8": ("--recipe", "ascend-w4a8", "--mtp", "drop"),
    "w4a16": ("--recipe", "ascend-w4a16", "--mtp", "drop"),
}
PHY2LOG = ((0, 1, 2, 3, 4, 5, 6, 7, 2),)  # 9 slots over 8 experts: expert 2 twice
LAYOUTS = {
    "tp2": [PL(tp_size=2, tp_rank=r) for r in range(2)],
    "tp4": [PL(tp_size=4, tp_rank=r) for r in range(4)],
    "tp2_attn_dp": [PL(tp_size=2, tp_rank=r, attn_dp=True) for r in range(2)],
    "pp2": [PL(pp_size=2, pp_rank=r) for r in range(2)],
    "ep2": [PL(ep_size=2, ep_rank=r, physical_to_logical=PHY2LOG) for r in range(2)],
    "tp2_pp2": [PL(tp_size=2, tp_rank=t, pp_size=2, pp_rank=p) for p in range(2) for t in range(2)],
}
REFUSED = {  # (artifact, layout) → text the refusal must contain
    ("awq", "tp2"): "o_proj (awq_w4a16, [out, in] = [256, 128]): in = 128 leaves 64",
    ("awq", "tp2_pp2"): "valid tp sizes: 1 (with attn_dp=True: 1, 2)",
    ("awq", "tp4"): "valid tp sizes: 1",
    ("fp4", "tp2"): "out = 256 leaves 128 per rank, not a multiple of 256",
    ("fp4", "tp2_pp2"): "nvfp4_ascend",
    ("fp4", "tp4"): "nvfp4_ascend",
    ("fp4", "tp2_attn_dp"): "shared_experts.gate_proj (nvfp4_ascend",
}
# module name suffix → the weight dim TP splits (None: replicated), attention / embedding marked
SPLIT = {
    "q_b_proj": (0, "attn"), "kv_b_proj": (0, "attn"), "o_proj": (1, "attn"),
    "gate_proj": (0, ""), "up_proj": (0, ""), "down_proj": (1, ""),
    "model.embed_tokens": (0, "attn"), "lm_head": (0, ""),
}  # fmt: skip


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Artifact]:
    src = tmp_path_factory.mktemp("src") / "tiny"
    shutil.copytree(TINY, src)
    out = {}
    for name, opts in ARTIFACTS.items():
        dst = tmp_path_factory.mktemp(name) / "art"
        res = run_cli("convert", src, dst, "--workers", "1", *opts)
        assert res.exit_code == 0, res.stderr
        out[name] = open_artifact(dst)
    return out


@pytest.fixture(scope="session")
def full(artifacts: dict[str, Artifact]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: art.load(PL(), mtp=True) for name, art in artifacts.items()}


def _expected_dim(prefix: str, lay: ParallelLayout) -> int | None:
    if lay.tp_size == 1 or (".experts." in prefix and lay.ep_size > 1):
        return None
    for suffix, (dim, kind) in SPLIT.items():
        if prefix.endswith(suffix):
            return None if (kind == "attn" and lay.attn_dp) else dim
    return None


def _group(art: Artifact, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """module id → {local key: tensor}."""
    out: dict[str, dict] = {}
    for mid, info in art.modules.items():
        local = {
            k: tensors[f"{info.prefix}.{k}"]
            for k in info.entries
            if f"{info.prefix}.{k}" in tensors
        }
        if local:
            out[mid] = local
    return out


def _weight(art: Artifact, mid: str, local: dict) -> torch.Tensor:
    fmt = art.modules[mid].fmt
    return fmt.dequantize(local) if fmt is not None else next(iter(local.values()))


def _nbytes(tensors: dict) -> int:
    return sum(t.nbytes for t in tensors.values())


CASES = [(a, lay) for a in ARTIFACTS for lay in LAYOUTS]


@pytest.mark.parametrize(("name", "lay_name"), CASES)
def test_ranks_reassemble_the_whole(artifacts, full, name: str, lay_name: str) -> None:
    art, layouts = artifacts[name], LAYOUTS[lay_name]
    if (name, lay_name) in REFUSED:
        with pytest.raises(HetquantError, match="valid tp sizes") as e:
            art.load(layouts[0])
        assert REFUSED[name, lay_name] in str(e.value)
        return
    ranks = []
    for lay in layouts:
        got = art.load(lay)
        assert art.last_load.bytes_read == _nbytes(got)  # reads exactly what it keeps
        ranks.append((lay, got, art.last_load.bytes_read))
    whole = {k: v for k, v in full[name].items() if not k.startswith("model.layers.3.")}  # MTP
    _check_union(art, whole, ranks)
    _check_shares(whole, ranks)


_WHOLE: dict[tuple[Path, str], torch.Tensor] = {}  # dequantized unsharded weights, reused


def _check_union(art: Artifact, whole: dict, ranks: list) -> None:
    modules = _group(art, whole)
    for mid, ref in modules.items():
        holders = [(lay, _group(art, got).get(mid)) for lay, got, _ in ranks]
        holders = [(lay, m) for lay, m in holders if m is not None]
        assert holders, f"{mid}: on no rank"
        (dim,) = {_expected_dim(art.modules[mid].prefix, lay) for lay, _ in holders}
        if dim is None:
            for _, m in holders:
                assert m.keys() == ref.keys() and all(_same(m[k], ref[k]) for k in ref), mid
            continue
        parts = sorted(((lay.tp_rank, lay.pp_rank), m) for lay, m in holders)
        assert [rank for (rank, _), _ in parts] == list(range(holders[0][0].tp_size)), mid
        got = torch.cat([_weight(art, mid, m) for _, m in parts], dim=dim)
        if (art.root, mid) not in _WHOLE:
            _WHOLE[art.root, mid] = _weight(art, mid, ref)
        assert torch.equal(got, _WHOLE[art.root, mid]), mid
        fmt = art.modules[mid].fmt
        if fmt is not None and fmt.name == "nvfp4_ascend":
            for (rank, _), m in parts:
                want = tiled_slice(ref, dim, rank, len(parts))
                assert all(_same(m[k], want[k]) for k in want), mid


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def _check_shares(whole: dict, ranks: list) -> None:
    """Split tensors: exactly 1/world of their bytes; a rank reads its share plus replicas."""
    world = ranks[0][0].tp_size
    for _, got, read in ranks:
        split = [k for k in got if got[k].shape != whole[k].shape]
        share = sum(whole[k].nbytes for k in split) / world
        replicated = _nbytes(got) - sum(got[k].nbytes for k in split)
        assert share <= sum(got[k].nbytes for k in split) <= 1.05 * share
        assert share <= read <= 1.05 * (share + replicated)


def test_pp_stages(artifacts) -> None:
    art = artifacts["bf16"]
    first, last = (art.load(PL(pp_size=2, pp_rank=r)) for r in range(2))
    layers = [
        {int(k.split(".")[2]) for k in s if k.startswith("model.layers.")} for s in (first, last)
    ]
    assert layers == [{0, 1}, {2}]  # 3 layers: vLLM gives the remainder to the first stage
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    assert {"model.norm.weight", "lm_head.weight"} <= last.keys() - first.keys()
    with_mtp = art.load(PL(pp_size=2, pp_rank=1), mtp=True)
    mtp = {k for k in with_mtp if k.startswith("model.layers.3.")}
    assert "model.layers.3.eh_proj.weight" in mtp and mtp == with_mtp.keys() - last.keys()
    assert not any(k.startswith("model.layers.3.") for k in art.load(PL(pp_size=2), mtp=True))


def _experts(tensors: dict, layer: int) -> set[int]:
    pre = f"model.layers.{layer}.mlp.experts."
    return {int(k[len(pre) :].split(".")[0]) for k in tensors if k.startswith(pre)}


def test_ep_ownership_with_redundant_expert(artifacts, full) -> None:
    art = artifacts["w8a8"]
    ranks = [art.load(lay) for lay in LAYOUTS["ep2"]]
    for layer in (1, 2):
        assert [_experts(r, layer) for r in ranks] == [{0, 1, 2, 3, 4}, {5, 6, 7, 2}]
    assert all(torch.equal(ranks[1][k], full["w8a8"][k]) for k in ranks[1])
    expert_bytes = _nbytes({k: v for k, v in ranks[1].items() if ".experts." in k})
    assert expert_bytes * 2 == _nbytes({k: v for k, v in full["w8a8"].items() if ".experts." in k})


def test_accel_experts_and_cpu_pool(artifacts) -> None:
    art = artifacts["awq"]
    assert _experts(art.load(PL(accel_experts=2)), 1) == {0, 1}
    got = art.load(PL(accel_experts={1: [6, 3]}))
    assert (_experts(got, 1), _experts(got, 2)) == ({3, 6}, set())
    both = art.load(PL(ep_size=2, ep_rank=1, accel_experts=6))
    assert _experts(both, 2) == {4, 5}
    hybrid = artifacts["hybrid"]
    assert not _experts(hybrid.load(PL()), 1)  # routed experts live in cpu_experts/ only
    assert sorted(hybrid.cpu_expert_files) == [1, 2]
    assert hybrid.cpu_expert_pool(subpools=2).layers == [1, 2]
    with pytest.raises(HetquantError, match="cpu_experts"):
        hybrid.load(PL(accel_experts=1))


def test_identified_formats(artifacts) -> None:
    def fmts(name: str) -> set[str]:
        return {i.fmt.name if i.fmt else "plain" for i in artifacts[name].modules.values()}

    assert fmts("bf16") == {"bf16", "plain"}
    assert fmts("hybrid") == fmts("w8a8") == {"w8a8_dynamic", "bf16", "plain"}
    assert fmts("awq") == {"awq_w4a16", "bf16", "plain"}
    assert fmts("fp4") == {"nvfp4_ascend", "bf16", "plain"}
    assert fmts("nvfp4") == {"nvfp4", "bf16", "plain"}
    awq = artifacts["awq"].modules["model.layers.1.mlp.experts.0.down_proj"]
    assert (awq.fmt.group_size, awq.shape) == (128, (256, 256))


def test_plan_spans(artifacts) -> None:
    art = artifacts["bf16"]
    reads = {r.name: r for r in art.plan(PL(tp_size=2, tp_rank=1))}
    col, row = (
        reads["model.layers.0.self_attn.q_b_proj.weight"],
        reads["model.layers.0.self_attn.o_proj.weight"],
    )
    assert (col.span.count, col.shape) == (1, (128, 128))  # rows 128..255: one contiguous range
    assert len(list(col.span.ranges())) == 1
    assert (row.span.count, row.span.run, row.span.stride) == (256, 64 * 2, 128 * 2)  # per row


def test_repack_hook(artifacts) -> None:
    art, calls = artifacts["awq"], []

    def repack(prefix, fmt, tensors):
        calls.append((prefix, fmt.name if fmt else None))
        return (
            {"w": fmt.dequantize(tensors)}
            if fmt is not None and fmt.name == "awq_w4a16"
            else tensors
        )

    got = art.load(PL(), repack=repack)
    assert "model.layers.0.self_attn.o_proj.w" in got and got[
        "model.layers.0.self_attn.o_proj.w"
    ].shape == (256, 128)
    assert ("model.layers.1.mlp.gate", "bf16") in calls and len(calls) == len(set(calls))


@pytest.mark.parametrize("stage", [None, 1000])  # 1000: every tensor crosses chunks
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_matches_cpu(artifacts, monkeypatch, stage: int | None) -> None:
    if stage is not None:
        monkeypatch.setattr(_reader, "_STAGE", stage)
    art = artifacts["nvfp4"]
    for lay in (PL(tp_size=2, tp_rank=1), PL(ep_size=2, ep_rank=1, physical_to_logical=PHY2LOG)):
        cpu, gpu = art.load(lay), art.load(lay, device="cuda")
        assert cpu.keys() == gpu.keys()
        assert all(gpu[k].is_cuda and _same(gpu[k].cpu(), cpu[k]) for k in cpu)


def test_chunks_cover_spans_in_order() -> None:
    for span in (Span(10, 2500, 2500), Span(7, 300, 1000, 9), Span(0, 5000, 8000, 3)):
        pieces = list(_reader._chunks(span, 1024))
        assert all(p.nbytes <= max(1024, span.run) for p, _ in pieces)
        got = [r for p, _ in pieces for r in p.ranges()]
        merged = [(a, b) for a, b in span.ranges()]
        if span.count == 1:
            assert (got[0][0], got[-1][1]) == merged[0] and len(got) == -(-span.run // 1024)
        else:
            assert got == merged
        assert [off for _, off in pieces] == sorted(off for _, off in pieces)


def _copy(art: Artifact, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(art.root, dst)
    return dst


def test_manifest_module_formats(artifacts, tmp_path: Path) -> None:
    root = _copy(artifacts["awq"], tmp_path)
    doc = json.loads((root / "hetquant.json").read_text())
    prefix = "model.layers.0.self_attn.o_proj"
    assert doc["module_formats"][prefix] == {
        "format": "awq_w4a16",
        "params": {"group_size": 128},
        "shape": [256, 128],
    }
    assert open_artifact(root).modules[prefix].shape == (256, 128)
    doc["module_formats"][prefix]["params"] = {"group_size": 64}
    (root / "hetquant.json").write_text(json.dumps(doc))
    with pytest.raises(HetquantError, match=r"o_proj: stored as awq_w4a16 for weight \[256, 128\]"):
        open_artifact(root)


def _modules(art: Artifact) -> dict[str, tuple]:
    return {m: (i.fmt, i.shape, sorted(i.entries)) for m, i in art.modules.items()}


@pytest.mark.parametrize("name", sorted(ARTIFACTS))
def test_recorded_formats_equal_identified_ones(artifacts, name: str, tmp_path: Path) -> None:
    """Schemas 2 and 3 record every module's format; the loader trusts it, and a schema-1
    manifest (no module_formats: formats recognised by identify) opens into the same modules."""
    art = artifacts[name]
    assert art.manifest["schema_version"] == 3
    recorded = art.manifest["module_formats"]
    assert recorded and all(art.modules[p].fmt is not None for p in recorded)
    stored_in_format = {m for m, i in art.modules.items() if i.fmt is not None}
    assert stored_in_format == set(recorded)
    root = _copy(art, tmp_path)
    doc = as_older_schema(json.loads((root / "hetquant.json").read_text()), root, 1)
    (root / "hetquant.json").write_text(json.dumps(doc))
    assert _modules(open_artifact(root)) == _modules(art)


def test_trusted_manifest_reads_unlisted_modules_as_plain(artifacts, tmp_path: Path) -> None:
    """A module the manifest does not list is plain tensors: here AWQ's, so the model has no
    o_proj weight, which config.json implies (issue 25 §2: refused, never run)."""
    root = _copy(artifacts["awq"], tmp_path)
    doc = json.loads((root / "hetquant.json").read_text())
    prefix = "model.layers.0.self_attn.o_proj"
    del doc["module_formats"][prefix]
    (root / "hetquant.json").write_text(json.dumps(doc))
    with pytest.raises(HetquantError, match=rf"implies {prefix}\.weight \[256, 128\], which no"):
        open_artifact(root)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: (r / "hetquant.json").unlink(), "no hetquant.json"),
        (lambda r: _edit(r / "hetquant.json", complete=False), "not marked complete"),
        (
            lambda r: _edit(
                r / "model.safetensors.index.json",
                weight_map={"lm_head.weight": "../x.safetensors"},
            ),
            "shard '../x.safetensors' points outside the artifact",
        ),
    ],
)
def test_bad_artifacts_refused(artifacts, tmp_path: Path, edit, needle: str) -> None:
    root = _copy(artifacts["bf16"], tmp_path)
    edit(root)
    with pytest.raises(HetquantError, match=needle):
        open_artifact(root)


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
