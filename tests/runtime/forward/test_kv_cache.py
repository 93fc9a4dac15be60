"""The KV-cache emulation ``fp8_ds_mla`` (``runtime/forward/kv_cache.py``) on hand-made keys —
its byte-level equality with vLLM's own CPU op is ``tests/runtime/vllm/test_vllm_deepseek_v4.py``
— and its use in the DeepSeek-V4 reference forward (opt-in, refused where a family has none)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support import run_cli

from hetquant.formats import HetquantError
from hetquant.runtime.forward.kv_cache import fp8_ds_mla, kv_cache
from hetquant.runtime.serving.run import RunSpec, local_model, run_artifact

NOPE, ROPE = 448, 64


def _row(nope: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
    """One 512-channel key row [1, 512] from its 448 nope channels (and 64 rope channels)."""
    rope = torch.zeros(ROPE) if rope is None else rope
    return torch.cat([nope, rope])[None]


def test_values_on_the_grid_come_back_unchanged() -> None:
    """Each 64-channel block whose amax is 448·2^k is stored with scale 2^k: values on the E4M3
    grid times 2^k (normals) are exact, and the rope channels are the bfloat16 rounding."""
    grid = torch.tensor([448.0, -1.0, 0.5, 0.0625, -0.015625, 3.25, 240.0, 0.0])  # E4M3 values
    nope = torch.cat([grid.repeat(8) * 2.0**k for k in (-10, -4, 0, 2, 5, 8, 11)])  # [448]
    rope = torch.randn(ROPE, generator=torch.Generator().manual_seed(0))
    out = fp8_ds_mla(_row(nope, rope))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0, :NOPE].float(), nope)
    assert torch.equal(out[0, NOPE:], rope.to(torch.bfloat16))


def test_small_blocks_use_the_floor_scale_and_flush_subnormals() -> None:
    """A block of amax 1e-3 is scaled by 2^-13 (not 2^-19): a value ≥ 2^-6 · 2^-13 keeps its
    E4M3 rounding, one below it is stored as 0 (no E4M3 subnormals)."""
    block = torch.zeros(64)
    block[0], block[1], block[2] = 1e-3, 2.0**-19 * 1.5, 2.0**-19 * 0.9  # |y| = 8.2, 0.023, 0.014
    out = fp8_ds_mla(_row(torch.cat([block, torch.zeros(NOPE - 64)])))[0].float()
    scale = 2.0**-13
    assert out[0] == torch.tensor(1e-3 / scale).to(torch.bfloat16).float().to(
        torch.float8_e4m3fn
    ).float() * scale  # fmt: skip
    assert out[1] == torch.tensor(2.0**-6 * 1.5).to(torch.float8_e4m3fn).float() * scale
    assert out[2] == 0.0


def test_relative_error_within_half_an_e4m3_step() -> None:
    """Where a value stores as an E4M3 normal, |x' − x| ≤ 2^-4·|x| (3 mantissa bits, round to
    nearest even) beyond its bfloat16 rounding; the rest (|x| below 2^-6 of its block's scale)
    is at most 2^-6 times that scale."""
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(
        -6, 3, 512
    )
    xb = x.to(torch.bfloat16).float()
    out = fp8_ds_mla(x).float()
    nope, back = xb[:, :NOPE].reshape(-1, 7, 64), out[:, :NOPE].reshape(-1, 7, 64)
    exp = torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True) / 448)).clamp(min=-13)
    scale = torch.exp2(exp)
    normal = (nope / scale).abs() >= 2.0**-6
    err = (back - nope).abs()
    assert bool((err[normal] <= nope.abs()[normal] * 2.0**-4).all())
    assert bool((err[~normal] <= (scale * 2.0**-6).expand_as(err)[~normal]).all())
    assert torch.equal(out[:, NOPE:], xb[:, NOPE:])


def test_bad_input_is_refused_with_one_line() -> None:
    with pytest.raises(HetquantError, match="keys of 128 channels") as e:
        fp8_ds_mla(torch.zeros(3, 128))
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(HetquantError, match="give one of fp8_ds_mla"):
        kv_cache("fp8")
    assert kv_cache(None) is None


@pytest.fixture(scope="module")
def v4_vllm_bf16(tiny_v4_vllm: dict[str, Path], tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("v4-vllm") / "bf16"
    res = run_cli("convert", tiny_v4_vllm["deepseek"], out, "--recipe", "bf16")
    assert res.exit_code == 0, res.stderr
    return out


KV_LOGIT_BOUND = 0.5  # measured 0.29 on these 40 tokens (|logits| up to 2.3)


def test_v4_forward_with_the_emulated_cache(v4_vllm_bf16: Path) -> None:
    """The emulation moves the logits (it is applied) and stays near the float forward: at most
    KV_LOGIT_BOUND (measured on 40 tokens of the ``--dims vllm`` tiny V4, every layer type);
    ``local_model`` and ``run_artifact`` agree on it."""
    tokens = torch.randint(0, 640, (40,), generator=torch.Generator().manual_seed(3))
    plain = local_model(v4_vllm_bf16).forward(tokens)
    fp8 = local_model(v4_vllm_bf16, kv_cache="fp8_ds_mla").forward(tokens)
    gap = float((fp8 - plain).abs().max())
    assert 1e-3 < gap <= KV_LOGIT_BOUND, gap
    logits, _ = run_artifact(
        RunSpec(str(v4_vllm_bf16), tuple(tokens.tolist()), kv_cache="fp8_ds_mla")
    )
    assert torch.equal(torch.from_numpy(logits), fp8)


def test_a_family_without_the_emulation_refuses_it(tiny_artifact: Path) -> None:
    with pytest.raises(
        HetquantError, match=r"--kv-cache fp8_ds_mla: the \S+ forward emulates no KV"
    ):
        run_artifact(RunSpec(str(tiny_artifact), (5, 17), kv_cache="fp8_ds_mla"))


def test_hetquant_run_cli_takes_the_emulation(v4_vllm_bf16: Path, tmp_path: Path) -> None:
    """``hetquant run --kv-cache fp8_ds_mla --dtype bfloat16`` gives the emulated forward's logits."""
    tokens = (5, 17, 42, 100, 7)
    res = run_cli("run", v4_vllm_bf16, "--tokens", ",".join(map(str, tokens)), "--kv-cache",
                  "fp8_ds_mla", "--dtype", "bfloat16", "--save-logits", tmp_path / "l.npy")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    want = local_model(v4_vllm_bf16, dtype="bfloat16", kv_cache="fp8_ds_mla").forward(
        torch.tensor(tokens)
    )
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "l.npy")), want)
