"""The converter's quantize kernels on aarch64 (the Kunpeng host of the A+K hybrid) give the bytes
they give on this x86-64 host.

``formats/_quant_native.cpp`` and ``formats/_rows_native.cpp`` (the library's one source,
``_quant_native._SOURCE``) and ``quant_kernels_driver.cpp`` are cross-compiled with
``aarch64-linux-gnu-g++`` (static, the library's flags) and run under ``qemu-aarch64``: there the
kernels take their generic C++ path (GCC's vectors become NEON). Every output byte of AWQ RTN,
NVFP4 in its three layouts, W8A8, INT4 (single and interleaved rows) and the FP8 dequantization
must equal what the best x86 path of this CPU gives through the Python wrappers — which the
other native tests hold to the torch references on every x86 path. Shapes take the tile tails
(rows past a 128-row tile, K past a 256-input tile, a last pair of rows, K % 16 tails).

Needs ``g++-aarch64-linux-gnu`` and ``qemu-user``; ``.ci/run`` installs them and sets
``HETQUANT_REQUIRE_CROSS=1``, under which a missing tool fails the test. Emulation says nothing
about speed.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support import aarch64_tools

from hetquant.formats import _quant_native as Q
from hetquant.formats import _rows_native as R

HERE = Path(__file__).resolve().parent
Driver = tuple[str, str, Path]  # qemu, the aarch64 driver, its scratch directory


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Driver:
    """(qemu, the aarch64 driver, a scratch directory)."""
    if platform.machine() != "x86_64" or not Q.available():
        pytest.skip("compares against the x86 kernels: run on an x86-64 host that builds them")
    cxx, qemu = aarch64_tools()
    tmp = tmp_path_factory.mktemp("quant-aarch64")
    src = tmp / "kernels.cpp"
    src.write_text(Q._SOURCE, encoding="utf-8")
    flags = [f for f in Q.QUANT_LIBRARY.flags if f not in ("-shared", "-fPIC")]
    exe = tmp / "driver"
    cmd = [cxx, *flags, "-static", "-o", str(exe), str(src), str(HERE / "quant_kernels_driver.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return qemu, str(exe), tmp


def _bf16_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    """BF16 bits [rows, cols]: normal values with exact zeros, -0.0, outliers and tiny values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    x[rng.random((rows, cols)) < 0.02] = 0.0
    x[rng.random((rows, cols)) < 0.01] = -0.0
    x[rng.random((rows, cols)) < 0.002] *= 300.0
    x[rng.random((rows, cols)) < 0.01] *= 1e-30
    if rows > 3:
        x[3] = 0.0  # an all-zero row
    return (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated: any BF16 value will do


def _run(driver: Driver, *args: object, dtypes: tuple[type, ...]) -> list[np.ndarray]:
    qemu, exe, tmp = driver
    out = tmp / "out"
    res = subprocess.run([qemu, exe, *map(str, args), str(out)], capture_output=True, timeout=600)
    assert res.returncode == 0, (args[0], res.returncode, res.stderr[-2000:])
    return [np.fromfile(f"{out}.{i}", dtype=d) for i, d in enumerate(dtypes)]


def _same(aarch64: list[np.ndarray], x86: tuple[np.ndarray, ...]) -> bool:
    return len(aarch64) == len(x86) and all(
        a.tobytes() == np.ascontiguousarray(b).tobytes() for a, b in zip(aarch64, x86, strict=True)
    )


def _write(driver: Driver, name: str, a: np.ndarray) -> Path:
    path = driver[2] / name
    a.tofile(path)
    return path


@pytest.mark.parametrize(
    ("rows", "cols", "group"), [(16, 256, 128), (24, 384, 64), (136, 640, 128)]
)
def test_awq(driver: Driver, rows: int, cols: int, group: int) -> None:
    w = _bf16_rows(rows, cols, rows + cols)
    x86 = Q.awq_rtn_array(w, group)
    assert x86 is not None
    got = _run(driver, "awq", rows, cols, group, _write(driver, "w.bin", w),
               dtypes=(np.int32, np.int32, np.uint16))  # fmt: skip
    assert _same(got, (x86["qweight"], x86["qzeros"], x86["scales"]))


@pytest.mark.parametrize(
    ("layout", "rows", "cols"),
    [("rows", 130, 528), ("rows", 3, 48), ("kmajor", 130, 528), ("kmajor", 10, 96),
     ("tiled", 256, 320), ("tiled", 512, 576)],
)  # fmt: skip
def test_nvfp4(driver: Driver, layout: str, rows: int, cols: int) -> None:
    w = _bf16_rows(rows, cols, 7 * rows + cols)
    amax = float(np.abs((w.astype(np.uint32) << 16).view(np.float32)).max())
    s2 = np.float32(amax / (6.0 * 448.0))
    x86 = Q.nvfp4_array(w, float(s2), layout)
    assert x86 is not None
    code = Q.NVFP4_LAYOUTS[layout]
    got = _run(driver, "nvfp4", rows, cols, code, int(s2.view(np.uint32)),
               _write(driver, "w.bin", w), dtypes=(np.uint8, np.uint8))  # fmt: skip
    assert _same(got, x86)


@pytest.mark.parametrize(("rows", "cols"), [(7, 130), (33, 2048), (1, 2)])
def test_w8a8(driver: Driver, rows: int, cols: int) -> None:
    w = _bf16_rows(rows, cols, 3 * rows + cols)
    x86 = R.w8a8_rows_array(w)
    assert x86 is not None
    got = _run(driver, "w8a8", rows, cols, _write(driver, "w.bin", w), dtypes=(np.int8, np.float32))
    assert _same(got, x86)


@pytest.mark.parametrize(
    ("rows", "cols", "pair"), [(9, 130, False), (33, 2048, False), (10, 64, True)]
)
def test_int4(driver: Driver, rows: int, cols: int, pair: bool) -> None:
    w = _bf16_rows(rows, cols, 5 * rows + cols)
    half = rows // 2
    x86 = R.int4_rows_array(w[:half], w[half:]) if pair else R.int4_rows_array(w)
    assert x86 is not None
    got = _run(driver, "int4", rows, cols, int(pair), _write(driver, "w.bin", w),
               dtypes=(np.uint8, np.float32))  # fmt: skip
    assert _same(got, x86)


@pytest.mark.parametrize(("rows", "cols", "block"), [(72, 1000, 128), (5, 300, 64)])
def test_fp8_dequant(driver: Driver, rows: int, cols: int, block: int) -> None:
    rng = np.random.default_rng(rows + cols)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes (their path is the caller's error)
    scales = (2.0 ** rng.uniform(-16, -8, -(-cols // block))).astype(np.float32)
    x86 = R.fp8_dequant_rows_array(codes, scales, block)
    assert x86 is not None
    got = _run(driver, "fp8", rows, cols, block, _write(driver, "codes.bin", codes),
               _write(driver, "scales.bin", scales), dtypes=(np.uint16,))  # fmt: skip
    assert _same(got, (x86,))


@pytest.mark.parametrize(("rows", "cols", "block", "spread"), [(300, 1000, 128, 8.0), (5, 300, 64, 0.0), (256, 384, 128, 2.0)])  # fmt: skip
def test_fp8_absmax(driver: Driver, rows: int, cols: int, block: int, spread: float) -> None:
    """The block walk (largest bound first, stop at the first bound not above the maximum): the
    same float on aarch64, with scales spread over ``spread`` octaves (0: every bound tied)."""
    rng = np.random.default_rng(rows + cols + block)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    codes &= rng.integers(0, 256, (rows, cols), dtype=np.uint8) | 0x80  # magnitudes thinned
    grid = (-(-rows // block), -(-cols // block))
    scales = (2.0 ** (rng.uniform(0, spread, grid) - 12)).astype(np.float32)
    x86 = R.fp8_absmax_array(codes, scales, block)
    assert x86 is not None
    got = _run(driver, "fp8max", rows, cols, block, _write(driver, "codes.bin", codes),
               _write(driver, "scales.bin", scales), dtypes=(np.float32,))  # fmt: skip
    assert _same(got, (np.array([x86], dtype=np.float32),))
