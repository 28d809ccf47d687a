"""Differential tests of the row formats: the C++ core (``dspark_core.formats``)
against gguf-py / numpy (``dspark_core.reference.formats``), byte for byte, on
every SIMD path this machine supports."""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest

from dspark_core import formats
from dspark_core.reference import formats as ref
from dspark_core.errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)
QT = {
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
PATHS = formats.simd_paths()
DIM = 256


def as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def gguf_encode(x: np.ndarray, storage: str) -> np.ndarray:
    """The oracle, straight from gguf-py / numpy (no policy, no quirk fix but
    the CPU's float -> int conversion, see as_on_x86)."""
    with np.errstate(all="ignore"):
        if storage == "f32":
            return x.astype(np.float32)
        if storage == "f16":
            return x.astype(np.float16)
        enc = gguf.quantize(x, QT[storage])
    return as_on_x86(x, storage, enc) if storage in ("q8_0", "q4_0") else enc


def as_on_x86(x: np.ndarray, storage: str, enc: np.ndarray) -> np.ndarray:
    """gguf-py's q8_0 / q4_0 bytes as numpy gives them on x86, on any CPU.

    numpy converts float to int with the CPU's instruction; the core's bytes
    are x86's on every CPU (docs/design.md 3.2). They differ only where
    ``x * id`` is infinite: a block whose fp32 inverse scale ``1 / d``
    overflows (every |x| below ~1e-37), where x86 gives the low byte of
    INT32_MIN (0) and Arm saturates (+inf -> 0xff; q4_0 clips that to 15).
    On x86 this changes nothing."""
    out = np.array(enc, dtype=np.uint8).reshape(-1, 34 if storage == "q8_0" else 18)
    for b, blk in enumerate(np.asarray(x, np.float32).reshape(-1, 32)):
        m = blk[int(np.argmax(np.abs(blk)))]
        d = np.abs(m) / np.float32(127) if storage == "q8_0" else m / np.float32(-8)
        with np.errstate(all="ignore"):
            if d != 0 and np.isinf(np.float32(1) / d):
                out[b, 2:] = 0
    return out.reshape(np.shape(enc))


def test_as_on_x86_rewrites_only_overflowing_inverse_scales() -> None:
    x = np.stack([CASES["f32_subnormal"][0, :64], CASES["gauss_1"][0, :64]]).astype(np.float32)
    for storage in ("q8_0", "q4_0"):
        enc = np.full((2, formats.row_bytes(storage, 64)), 0xAB, np.uint8)
        got = as_on_x86(x, storage, enc)
        assert np.all(got[0].reshape(2, -1)[:, 2:] == 0) and np.all(got[0].reshape(2, -1)[:, :2] == 0xAB)
        assert np.all(got[1] == 0xAB)


def normalise_q4_zero_blocks(x: np.ndarray, enc: np.ndarray) -> np.ndarray:
    """ggml's C code stores d = -0.0 (0x8000) for an all-zero q4_0 block (its
    running max starts at +0 and d = +0 / -8). gguf-py takes the block's first
    element as the max, so it agrees unless that element is -0.0, where it
    stores +0 (0x0000). We follow C; this maps gguf-py's bytes to C's in just
    that case."""
    out = np.array(enc, dtype=np.uint8).reshape(-1, 18)
    zero = np.all(x.reshape(-1, 32) == 0, axis=1)
    out[zero, 0], out[zero, 1] = 0x00, 0x80
    return out.reshape(-1)


def cases() -> dict[str, np.ndarray]:
    """Named float32 (rows, DIM) inputs covering the awkward cases."""
    rng = np.random.default_rng(20240611)
    c: dict[str, np.ndarray] = {}
    for scale in (1e-4, 1.0, 1e3):
        c[f"gauss_{scale:g}"] = (rng.standard_normal((8, DIM)) * scale).astype(np.float32)
    c["student_t3"] = rng.standard_t(3, (8, DIM)).astype(np.float32)
    m = rng.standard_normal((8, DIM)).astype(np.float32)
    for r in range(8):  # "massive activations": a few channels at 1e3-1e4
        cols = rng.choice(DIM, 3, replace=False)
        m[r, cols] = rng.uniform(1e3, 1e4, 3).astype(np.float32) * rng.choice([-1, 1], 3)
    c["massive"] = m
    z = rng.standard_normal((4, DIM)).astype(np.float32)
    z[:, 32:96] = 0.0
    z[1, 128:160] = -0.0  # all -0.0 block
    z[2, 160] = -0.0  # all-zero block whose first element is -0.0
    z[2, 161:192] = 0.0
    c["zero_blocks"] = z
    k = rng.integers(-127, 128, (4, DIM))
    c["grid_3k_127"] = (3.0 * k / 127.0).astype(np.float32)
    # q8_0 exact ties: amax = 127 -> d = 1, id = 1, so x * id = k + 0.5.
    t = (rng.integers(-126, 126, (4, DIM)) + 0.5).astype(np.float32)
    t[:, ::32] = 127.0
    c["q8_ties"] = t
    # q8_0 near-ties: just below / above k + 0.5.
    nt = t.copy()
    nt[:, 1::2] = np.nextafter(nt[:, 1::2], np.float32(0))
    nt[:, 1::32] = 127.0
    c["q8_near_ties"] = nt
    # q4_0: equal-magnitude opposite-sign maxima (first one wins) and ties in x*id + 8.5.
    q = rng.integers(-7, 8, (4, DIM)).astype(np.float32)
    q[0, 3::32], q[0, 9::32] = 8.0, -8.0
    q[1, 3::32], q[1, 9::32] = -8.0, 8.0
    q[2, 0::32], q[2, 31::32] = -5.5, 5.5
    c["q4_opposite_max"] = q
    c["d_overflow"] = (rng.standard_normal((4, DIM)) * 1e6).astype(np.float32)  # d -> inf in fp16
    c["d_underflow"] = (rng.standard_normal((4, DIM)) * 1e-9).astype(np.float32)  # d -> 0 in fp16
    c["f16_edges"] = rng.choice(
        np.array([65504, 65519.99, 65520, -65520, 6.1e-5, 5.96e-8, 2.98e-8, 1e-8, 7e4], np.float32),
        (2, DIM),
    ).astype(np.float32)
    c["f32_subnormal"] = (rng.standard_normal((2, DIM)) * 1e-41).astype(np.float32)  # id = inf
    return c


CASES = cases()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_encode_matches_gguf_py(name: str, storage: str, path: str) -> None:
    x = CASES[name]
    # "keep": the bytes of every value, overflowing ones too (d_overflow,
    # f16_edges); "error" rejects those (test_overflow_*).
    with formats.simd_path(path):
        got = formats.quantize_rows(x, storage, nonfinite="keep")
    want = gguf_encode(x, storage)
    if storage == "q4_0":
        want = normalise_q4_zero_blocks(x, want)
    assert got.dtype == formats.storage_dtype(storage)
    assert got.shape == (x.shape[0], formats.row_bytes(storage, DIM) // (1 if storage[0] == "q" else got.itemsize))
    np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
    np.testing.assert_array_equal(as_bytes(got), as_bytes(ref.encode(x, storage, "keep")))


def test_q4_all_zero_block_quirk() -> None:
    """ggml C: all-zero q4_0 block -> d = 0x8000 (-0.0), every nibble 8."""
    enc = formats.quantize_rows(np.zeros(32, np.float32), "q4_0")
    assert enc.tobytes() == b"\x00\x80" + b"\x88" * 16
    neg = formats.quantize_rows(np.full(32, -0.0, np.float32), "q4_0")
    assert neg.tobytes() == enc.tobytes()
    # gguf-py: first element -0.0 -> d = +0 (the one case we normalise above).
    assert gguf.quantize(np.full((1, 32), -0.0, np.float32), QT["q4_0"])[0, :2].tolist() == [0, 0]


def test_hand_checked_vectors() -> None:
    x = np.zeros(32, np.float32)
    x[:5] = [127.0, 0.5, -0.5, 2.5, -3.5]
    q = formats.quantize_rows(x, "q8_0")[0]
    assert q[:2].tolist() == [0x00, 0x3C]  # d = 1.0
    assert q[2:7].view(np.int8).tolist() == [127, 1, -1, 3, -4]  # halves away from zero
    y = np.zeros(32, np.float32)
    y[5], y[20] = 8.0, -8.0  # the first max-magnitude element wins: d = 8 / -8 = -1
    q4 = formats.quantize_rows(y, "q4_0")[0]
    assert q4[:2].tolist() == [0x00, 0xBC]
    assert q4[2 + 5] & 0xF == 0 and q4[2 + 4] >> 4 == 15


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_every_path_identical_bytes_random(storage: str) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((33, 32 * 41)).astype(np.float32) * rng.uniform(1e-3, 1e4, (33, 1)).astype(np.float32)
    bits = rng.integers(0, 2**32, (5, 32 * 41), dtype=np.uint64).astype(np.uint32).view(np.float32)
    outs = []
    for p in PATHS:
        with formats.simd_path(p):
            a = formats.quantize_rows(x, storage)
            b = formats.quantize_rows(bits, storage, nonfinite="keep")
            c = formats.quantize_rows(bits, storage, nonfinite="clamp_f16")
            d = formats.dequantize_rows(a, storage, x.shape[1], BF16)
            outs.append([as_bytes(v).copy() for v in (a, b, c, d)])
    for o in outs[1:]:
        for u, v in zip(outs[0], o):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("name", ["gauss_1", "massive", "zero_blocks", "d_overflow", "d_underflow", "q8_ties"])
def test_decode_matches_gguf_py(name: str, storage: str, path: str) -> None:
    x = CASES[name]
    enc = ref.encode(x, storage, "keep")
    with formats.simd_path(path):
        f32 = formats.dequantize_rows(enc, storage, DIM)
        f16 = formats.dequantize_rows(enc, storage, DIM, np.float16)
        bf = formats.dequantize_rows(enc, storage, DIM, BF16)
    raw = as_bytes(enc)
    if storage == "f32":
        want = raw.view(np.float32)
    elif storage == "f16":
        want = gguf.dequantize(raw.view(np.float16), gguf.GGMLQuantizationType.F16)
    elif storage == "bf16":
        want = gguf.dequantize(raw, QT["bf16"])
    else:
        blocks = raw.reshape(-1, 34 if storage == "q8_0" else 18)
        with np.errstate(all="ignore"):  # inf d * 0 in d_overflow
            want = np.asarray(gguf.dequantize(blocks, QT[storage]), np.float32).reshape(-1, 32)
        # inf * 0 is the CPU's default NaN: x86's (0xffc00000) is the core's on every CPU.
        inf_d = np.isinf(blocks[:, :2].copy().view(np.float16).reshape(-1))
        want.view(np.uint32)[inf_d[:, None] & np.isnan(want)] = 0xFFC00000
    want = np.asarray(want, np.float32).reshape(-1, DIM)
    assert f32.dtype == np.float32 and f32.shape == (x.shape[0], DIM)
    np.testing.assert_array_equal(f32.view(np.uint32), want.view(np.uint32))
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(f16.view(np.uint16), want.astype(np.float16).view(np.uint16))
    # bf16: one RNE step, (u + 0x7fff + ((u >> 16) & 1)) >> 16 (no NaNs here).
    u = want.view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(bf.view(np.uint16), rne)


@pytest.mark.parametrize("storage", ["q8_0", "q4_0"])
def test_zero_quant_of_an_infinite_scale_decodes_to_x86s_nan(storage: str) -> None:
    """inf * 0 is x86's default NaN 0xffc00000 on every CPU and path (Arm's own is
    0x7fc00000), in the core and in the reference twin; inf * +-1 is +-inf."""
    nb = 34 if storage == "q8_0" else 18
    blocks = np.zeros((2, nb), np.uint8)
    blocks[0, :2], blocks[1, :2] = [0x00, 0x7C], [0x00, 0xFC]  # d = +inf, -inf
    if storage == "q8_0":
        blocks[:, 3], blocks[:, 4] = 1, 0xFF  # quants 0, 1, -1, 0, ...
        want = [0xFFC00000, 0x7F800000, 0xFF800000]
    else:
        blocks[:, 2] = 0x98  # element 0: nibble 8 (0); element 16: nibble 9 (+1)
        want = [0xFFC00000, 0x7F800000]
    for path in PATHS:
        with formats.simd_path(path):
            got = formats.dequantize_rows(blocks.reshape(1, -1), storage, 64).view(np.uint32).reshape(2, 32)
        twin = ref.decode(blocks.reshape(1, -1), storage, 64).view(np.uint32).reshape(2, 32)
        np.testing.assert_array_equal(got, twin)
        first = [got[0, 0], got[0, 1], got[0, 2]] if storage == "q8_0" else [got[0, 0], got[0, 16]]
        assert first == want, (path, [hex(v) for v in first])
        assert got[1, 0] == 0xFFC00000


def test_decode_into_out_and_flat_bytes() -> None:
    x = CASES["gauss_1"]
    enc = formats.quantize_rows(x, "q4_0")
    out = np.empty((x.shape[0], DIM), np.float32)
    res = formats.dequantize_rows(enc.reshape(-1), "q4_0", DIM, out=out)
    assert res is out
    np.testing.assert_array_equal(out, ref.decode(enc, "q4_0", DIM))
    with pytest.raises(ValueError):
        formats.dequantize_rows(enc.reshape(-1)[:-1], "q4_0", DIM)
    with pytest.raises(ValueError):
        formats.dequantize_rows(enc, "q4_0", DIM, out=np.empty((1, DIM), np.float32))


@pytest.mark.parametrize("in_dtype", [np.float16, BF16])
@pytest.mark.parametrize("storage", formats.STORAGES)
def test_half_inputs(in_dtype: object, storage: str) -> None:
    x = (CASES["massive"] / 16).astype(in_dtype)
    got = formats.quantize_rows(x, storage)
    want = ref.encode(x, storage)
    np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
    same = {"f16": np.dtype(np.float16), "bf16": BF16}.get(storage)
    if same == np.dtype(in_dtype):
        np.testing.assert_array_equal(as_bytes(got), as_bytes(x))  # same type: a copy


def test_one_d_input_is_one_row() -> None:
    x = CASES["gauss_1"][0]
    assert formats.quantize_rows(x, "q8_0").shape == (1, formats.row_bytes("q8_0", DIM))
    assert formats.quantize_rows(x, "f16").shape == (1, DIM)


def test_nonfinite_error_names_row_and_column() -> None:
    x = np.ones((3, 64), np.float32)
    x[2, 17] = np.inf
    x[2, 40] = np.nan
    with pytest.raises(ValueError, match=r"row 2, column 17"):
        formats.quantize_rows(x, "q8_0")
    h = x.astype(np.float16)
    with pytest.raises(ValueError, match=r"row 2, column 17"):
        formats.quantize_rows(h, "f32")
    assert formats.find_nonfinite(x) == 2 * 64 + 17


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_nonfinite_policies(storage: str) -> None:
    x = CASES["gauss_1"][:2].copy() * 1e5
    x[0, 3], x[0, 70], x[1, 5], x[1, 6] = np.nan, np.inf, -np.inf, -1e9
    for pol in ("zero", "clamp_f16"):
        got = formats.quantize_rows(x, storage, nonfinite=pol)
        np.testing.assert_array_equal(as_bytes(got), as_bytes(ref.encode(x, storage, pol)))
    z = formats.dequantize_rows(formats.quantize_rows(x, "f32", nonfinite="zero"), "f32", DIM)
    assert z[0, 3] == 0 and z[0, 70] == 0 and z[1, 5] == 0 and z[1, 6] == -1e9
    c = formats.dequantize_rows(formats.quantize_rows(x, "f32", nonfinite="clamp_f16"), "f32", DIM)
    assert c[0, 3] == 0 and c[0, 70] == 65504 and c[1, 5] == -65504 and c[1, 6] == -65504
    assert np.all(np.abs(c) <= 65504)


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_keep_policy_matches_gguf_py(storage: str) -> None:
    """'keep' converts as-is: NaN stays quiet (f16/bf16); a q block holding a
    NaN gets d = NaN and zero quants, an Inf gives d = +-inf, as gguf-py."""
    x = CASES["gauss_1"][:2].copy()
    x[0, 3], x[0, 70], x[1, 200] = np.nan, np.inf, -np.inf
    got = formats.quantize_rows(x, storage, nonfinite="keep")
    want = gguf_encode(x, storage)
    np.testing.assert_array_equal(as_bytes(got), as_bytes(want))


# f32 NaN bits -> the f16 NaN that F16C's vcvtps2ph gives: sign, quiet bit, and
# the top 9 payload bits (worked by hand from the bit layouts). numpy's cast
# keeps a signalling NaN signalling, and turns 0x7f800001 into 0x7c01.
F32_TO_F16_NAN = [
    (0x7F800001, 0x7E00),  # signalling, payload only below the top 10 bits
    (0xFF800001, 0xFE00),
    (0x7F801FFF, 0x7E00),
    (0xFF802000, 0xFE01),  # signalling, lowest kept payload bit set
    (0x7FB70000, 0x7FB8),  # signalling, 0x1b8 kept, quiet bit added
    (0x7FC00000, 0x7E00),  # the default quiet NaN
    (0xFFC00001, 0xFE00),
    (0x7FFFFFFF, 0x7FFF),
]


@pytest.mark.parametrize("path", PATHS)
def test_f32_to_f16_nan_rule_hand_checked(path: str) -> None:
    src = np.array([f for f, _ in F32_TO_F16_NAN], np.uint32).view(np.float32).reshape(1, -1)
    want = [h for _, h in F32_TO_F16_NAN]
    with formats.simd_path(path):
        enc = formats.quantize_rows(src, "f16", nonfinite="keep")
        dec = formats.dequantize_rows(src, "f32", src.shape[1], np.float16)
    assert enc.view(np.uint16).reshape(-1).tolist() == want
    assert dec.view(np.uint16).reshape(-1).tolist() == want
    assert ref.encode(src, "f16", "keep").view(np.uint16).reshape(-1).tolist() == want
    assert ref.decode(src, "f32", src.shape[1], np.float16).view(np.uint16).reshape(-1).tolist() == want


@pytest.mark.parametrize("path", PATHS)
def test_arbitrary_f32_bits_to_f16_match_reference(path: str) -> None:
    """Every f32 bit pattern class (NaNs of every payload, infs, subnormals,
    overflow, ties) narrowed to f16 by encode and by decode equals the oracle."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, 64 * 1031, dtype=np.uint64).astype(np.uint32)
    bits[::3] = (bits[::3] & 0x803FFFFF) | 0x7F800000  # every third a NaN/inf, mostly signalling
    x = bits.view(np.float32).reshape(64, 1031)
    with formats.simd_path(path):
        enc = formats.quantize_rows(x, "f16", nonfinite="keep")
        dec = formats.dequantize_rows(x, "f32", x.shape[1], np.float16)
    want = ref.encode(x, "f16", "keep").view(np.uint16)
    np.testing.assert_array_equal(enc.view(np.uint16), want)
    np.testing.assert_array_equal(dec.view(np.uint16), want)


def test_bad_dtype_and_config() -> None:
    with pytest.raises(TypeError, match="float64"):
        formats.quantize_rows(np.ones((2, 32)), "q8_0")
    with pytest.raises(TypeError):
        formats.quantize_rows(np.ones((2, 32), np.int32), "f16")
    with pytest.raises(TypeError):
        formats.dequantize_rows(np.zeros((1, 34), np.uint8), "q8_0", 32, out_dtype=np.float64)
    with pytest.raises(ConfigError):
        formats.quantize_rows(np.ones((2, 40), np.float32), "q8_0")
    with pytest.raises(ConfigError):
        formats.row_bytes("q4_0", 48)
    with pytest.raises(ConfigError):
        formats.quantize_rows(np.ones((2, 32), np.float32), "q5_0")
    with pytest.raises(ValueError):
        formats.quantize_rows(np.ones((2, 32), np.float32), "f16", nonfinite="ignore")
    assert formats.row_bytes("q8_0", 25600) == 25600 // 32 * 34
    assert formats.row_bytes("bf16", 7) == 14


def test_simd_path_control() -> None:
    assert PATHS[0] == "scalar"
    assert formats.active_simd_path() in PATHS
    assert formats.best_simd_path() == PATHS[-1]
    with formats.simd_path("scalar"):
        assert formats.active_simd_path() == "scalar"
    with pytest.raises(ValueError):
        formats.set_simd_path("sve")


@pytest.mark.parametrize("path", formats.simd_paths())
@pytest.mark.parametrize("bad_at", [None, 0, 7, 20, 300_001, 307_199])
def test_large_f32_copy_check_every_path(path, bad_at):
    """f32 -> f32 ingest copies large inputs with streaming stores (after an alignment peel):
    the bytes are a copy and the first non-finite element is found wherever it lies."""
    x = np.random.default_rng(5).standard_normal(600 * 512).astype(np.float32)
    if bad_at is not None:
        x[bad_at] = np.inf
        x[-1] = np.nan  # a later one must not win
    for offset in (0, 1, 5):  # the destination's alignment varies with where the rows start
        buf = np.zeros(x.size + 16, np.float32)
        out = buf[offset: offset + x.size].reshape(600, 512)
        with formats.simd_path(path):
            if bad_at is None:
                formats.quantize_rows(x.reshape(600, 512), "f32", out=out)
                assert out.tobytes() == x.tobytes()
            else:
                with pytest.raises(ValueError) as err:
                    formats.quantize_rows(x.reshape(600, 512), "f32", out=out)
                assert f"row {bad_at // 512}" in str(err.value) and f"column {bad_at % 512}" in str(err.value)
                kept = formats.quantize_rows(x.reshape(600, 512), "f32", nonfinite="keep")
                assert kept.tobytes() == x.tobytes()
