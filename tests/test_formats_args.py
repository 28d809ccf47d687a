"""Conversion calls a server gets wrong: overlapping ``out=``, a failed call's
``out=``, sizes that overflow, ``None`` and wrong-type arguments, a bad
``DSPARK_SIMD``. Each is rejected with a clear exception and changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from dspark_core import formats
from dspark_core.reference import formats as reference_formats

D = 64
ROWS = 16


def activations(n: int = ROWS, dim: int = D, seed: int = 0) -> np.ndarray:
    """Rows shaped like a real model's hidden states: N(0, 1) noise, a few
    massive channels (1e3-1e4, inside f16's range), a huge-norm BOS row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[:, 3] *= 2e3
    x[:, dim - 5] = 9e3 * np.sign(x[:, dim - 5] + 0.1)
    x[0] *= 4.0  # BOS
    return x


# -- out= overlapping the input ------------------------------------------------


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_encode_into_its_own_input_is_rejected(storage: str) -> None:
    xbytes = 4 * ROWS * D
    raw = np.zeros(3 * xbytes, np.uint8)  # the input sits in the middle third
    x = raw[xbytes : 2 * xbytes].view(np.float32).reshape(ROWS, D)
    x[:] = activations()
    before = raw.copy()
    dt = formats.storage_dtype(storage)
    shape = formats.quantize_rows(x, storage).shape
    nbytes = int(np.prod(shape)) * dt.itemsize  # a multiple of 64 here: every view stays aligned

    def out_at(start: int) -> np.ndarray:
        return raw[start : start + nbytes].view(dt).reshape(shape)

    # Ending 64 bytes into the input, the same start, starting in its middle or 64 bytes before its end.
    for start in (xbytes - nbytes + 64, xbytes, xbytes + xbytes // 2, 2 * xbytes - 64):
        with pytest.raises(ValueError, match="overlaps"):
            formats.quantize_rows(x, storage, out=out_at(start))
        assert raw.tobytes() == before.tobytes()
    # Adjacent on either side is fine, and gives the reference's bytes.
    want = reference_formats.encode(activations(), storage).tobytes()
    for start in (xbytes - nbytes, 2 * xbytes):
        out = out_at(start)
        assert formats.quantize_rows(x, storage, out=out) is out
        assert out.tobytes() == want


@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_decode_into_its_own_input_is_rejected(storage: str, out_dtype) -> None:
    enc = formats.quantize_rows(activations(), storage)
    nbytes = ROWS * D * np.dtype(out_dtype).itemsize
    buf = np.zeros(enc.nbytes + nbytes + 256, np.uint8)
    data = buf[: enc.nbytes].view(enc.dtype).reshape(enc.shape)
    data[:] = enc
    want = reference_formats.decode(enc.view(np.uint8).reshape(ROWS, -1), storage, D, out_dtype)
    for start in (0, 2, enc.nbytes // 3, enc.nbytes - 2):
        out = buf[start : start + nbytes].view(out_dtype).reshape(ROWS, D)
        with pytest.raises(ValueError, match="overlaps"):
            formats.dequantize_rows(data, storage, D, out_dtype, out=out)
        assert data.tobytes() == enc.tobytes()
    # The defect this pins: a q4_0 dequantize in place returned 3,737 of 4,096 values wrong.
    out = buf[enc.nbytes : enc.nbytes + nbytes].view(out_dtype).reshape(ROWS, D)
    formats.dequantize_rows(data, storage, D, out_dtype, out=out)
    assert out.tobytes() == want.tobytes()


def test_overlap_through_a_different_view_of_the_same_base() -> None:
    base = np.zeros((ROWS, D), np.float32)
    base[:] = activations()
    same = base.reshape(-1)[: ROWS * D].reshape(ROWS, D)  # another view object, same memory
    with pytest.raises(ValueError, match="overlaps"):
        formats.quantize_rows(base, "f32", out=same)
    half = base.view(np.uint8)[:, : D * 2].view(np.float16)  # not C-contiguous: rejected for that
    with pytest.raises(ValueError):
        formats.quantize_rows(base, "f16", out=half)


# -- a rejected conversion leaves out= as it was --------------------------------


@pytest.mark.parametrize("in_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("bad", ["nan", "inf", "last_row"])
def test_failed_encode_leaves_out_untouched(storage: str, in_dtype, bad: str) -> None:
    x = activations()
    if bad == "nan":
        x[5, 17] = np.nan
    elif bad == "inf":
        x[0, 0] = -np.inf
    else:
        x[ROWS - 1, D - 1] = np.nan
    x = x.astype(in_dtype)
    dt = formats.storage_dtype(storage)
    shape = formats.quantize_rows(x, storage, nonfinite="keep").shape
    out = np.full(shape, 7, np.uint8) if dt == np.uint8 else np.full(shape, 3.5, dt)
    before = out.tobytes()
    with pytest.raises(ValueError, match="non-finite|unencodable|overflow"):
        formats.quantize_rows(x, storage, out=out)
    assert out.tobytes() == before


def test_overflow_rejection_leaves_out_untouched() -> None:
    """A finite value f16 cannot hold (a massive activation of 87,929) is rejected like NaN."""
    x = activations()
    x[0, 3] = 87_929.0
    out = np.full((ROWS, D), 1.25, np.float16)
    with pytest.raises(ValueError):
        formats.quantize_rows(x, "f16", out=out)
    assert (out == np.float16(1.25)).all()


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_out_is_filled_when_every_value_is_finite(storage: str) -> None:
    x = activations(seed=3)
    dt = formats.storage_dtype(storage)
    want = reference_formats.encode(x, storage)
    out = np.zeros(formats.quantize_rows(x, storage).shape, dt)
    assert formats.quantize_rows(x, storage, out=out) is out
    assert out.tobytes() == want.tobytes()


# -- sizes that overflow ---------------------------------------------------------


@pytest.mark.parametrize(
    "storage, n",
    [("f32", 2**62 + 1), ("f32", 2**63), ("f16", 2**63), ("bf16", 2**63 + 7), ("q8_0", 2**64 - 32),
     ("f32", 2**64 - 1)],
)
def test_row_bytes_that_would_wrap_around_raise(storage: str, n: int) -> None:
    with pytest.raises(ValueError, match="overflow|too large"):
        formats.row_bytes(storage, n)


@pytest.mark.parametrize("n", [-1, 2**64, 2**70])
def test_row_bytes_outside_size_t_raise_value_error(n: int) -> None:
    with pytest.raises(ValueError, match="feature_dim"):
        formats.row_bytes("f32", n)


def test_row_bytes_near_the_limit_are_exact() -> None:
    assert formats.row_bytes("f32", 2**61 - 1) == (2**61 - 1) * 4
    assert formats.row_bytes("q8_0", 2**32 * 32) == 2**32 * 34
    assert formats.row_bytes("q4_0", 32) == 18
    assert formats.row_bytes("q4_0", 2**64 - 32) == (2**59 - 1) * 18  # 18 bytes per 32 elements never wraps


# -- None and wrong-type arguments -------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x: formats.quantize_rows(x, None), "storage"),
        (lambda x: formats.quantize_rows(x, 3), "storage"),
        (lambda x: formats.quantize_rows(x, "f16", nonfinite=None), "nonfinite"),
        (lambda x: formats.quantize_rows(None, "f16"), "quantize_rows"),
        (lambda x: formats.quantize_rows(x, "f16", out=[1, 2]), "out"),
        (lambda x: formats.dequantize_rows(formats.quantize_rows(x, "q8_0"), None, D), "storage"),
        (lambda x: formats.dequantize_rows(formats.quantize_rows(x, "q8_0"), "q8_0", None), "feature_dim"),
        (lambda x: formats.dequantize_rows(formats.quantize_rows(x, "q8_0"), "q8_0", 64.0), "feature_dim"),
        (lambda x: formats.dequantize_rows(formats.quantize_rows(x, "q8_0"), "q8_0", D, None), "out_dtype"),
        (lambda x: formats.dequantize_rows(None, "q8_0", D), "data"),
        (lambda x: formats.dequantize_rows(formats.quantize_rows(x, "q8_0"), "q8_0", D, out="x"), "out"),
        (lambda x: formats.find_nonfinite(None), "find_nonfinite"),
        (lambda x: formats.find_nonfinite([1.0, 2.0]), "find_nonfinite"),
        (lambda x: formats.row_bytes(None, D), "storage"),
        (lambda x: formats.row_bytes("f32", None), "feature_dim"),
        (lambda x: formats.storage_dtype(None), "storage"),
        (lambda x: formats.set_simd_path(None), "name"),
    ],
)
def test_wrong_type_arguments_raise_type_error_naming_them(call, name: str) -> None:
    with pytest.raises(TypeError, match=name):
        call(activations())


# -- DSPARK_SIMD ----------------------------------------------------------------------


def _import_with_simd_env(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSPARK_SIMD=value)
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import dspark_core.formats as f\n"
        "print('ACTIVE', f.active_simd_path(), f.best_simd_path())\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["bogus", "avx3", "AVX-2"])
def test_unknown_simd_env_value_warns_and_names_the_valid_values(value: str) -> None:
    r = _import_with_simd_env(value)
    assert r.returncode == 0, r.stderr
    assert f"DSPARK_SIMD={value!r}" in r.stderr
    assert "scalar, avx2, avx512" in r.stderr
    active, best = r.stdout.split()[1:]
    assert active == best


def test_known_simd_env_value_is_used_without_a_warning() -> None:
    r = _import_with_simd_env("scalar")
    assert r.returncode == 0, r.stderr
    assert "DSPARK_SIMD" not in r.stderr
    assert r.stdout.split()[1] == "scalar"
