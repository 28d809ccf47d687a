"""Real activations: overflow is non-finite, on every path, in the core and the reference.

Real models have "massive activation" channels (Gemma 3 270M: 87,929 on
ordinary text, on the BOS row already). A finite value whose encoding is not
finite (f16 >= 65520, a q8_0 / q4_0 block whose fp16 scale overflows, or a
value that overflows the stage dtype) must be treated like a NaN by every
policy: rejected under "error", zeroed under "zero", clamped under "clamp".
Oracles: hand-derived IEEE thresholds, and the pure-Python reference, which
derives its bounds from gguf-py / numpy by bisection.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import MASSIVE_PEAK, feature_rows, massive_rows

from dspark_core import StagerConfig, formats
from dspark_core.reference import formats as ref

PATHS = formats.simd_paths()
DIM = 256
STAGED = ("float32", "float16", "bfloat16")


def f32_bits(v: float) -> int:
    return int(np.array([v], np.float32).view(np.uint32)[0])


def next_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(0)))


# -- the bounds ------------------------------------------------------------------

#: Hand-derived: 65520 is the f16 rounding midpoint above 65504 (ties to even:
#: to +inf); bf16 0x7f7f8000 rounds up to 0x7f80; q8_0's d = amax / 127 and
#: q4_0's d = max / -8 reach 65520 from 127 * 65520 and 8 * 65520 on.
HAND_LIMITS = {
    "f32": float("inf"),
    "f16": 65520.0,
    "bf16": float(np.array([0x7F7F8000], np.uint32).view(np.float32)[0]),
    "q8_0": 127 * 65520.0,
    "q4_0": 8 * 65520.0,
}


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_storage_bounds_are_the_hand_derived_thresholds(storage: str) -> None:
    b = formats.encode_bounds(storage)
    assert b.limit == HAND_LIMITS[storage]
    # clamp_to: the largest magnitude below the limit (FLT_MAX for f32).
    want = float(np.finfo(np.float32).max) if storage == "f32" else next_down(HAND_LIMITS[storage])
    assert b.clamp_to == want


@pytest.mark.parametrize("staged", STAGED)
@pytest.mark.parametrize("storage", formats.STORAGES)
def test_core_bounds_match_the_reference_bisection(storage: str, staged: str) -> None:
    dt = ml_dtypes.bfloat16 if staged == "bfloat16" else staged
    assert tuple(formats.encode_bounds(storage, dt)) == ref.bounds(storage, staged)


@pytest.mark.parametrize("storage", formats.STORAGES)
def test_values_at_the_bounds_round_trip_as_promised(storage: str) -> None:
    """Just below the limit stays finite through encode + decode; at the limit it does not."""
    b = formats.encode_bounds(storage)
    if storage == "f32":
        return  # no finite float32 overflows f32 storage
    below = np.full((1, 32), b.clamp_to, np.float32)
    at = np.full((1, 32), b.limit, np.float32)
    assert np.isfinite(formats.dequantize_rows(formats.quantize_rows(below, storage), storage, 32)).all()
    bad = formats.dequantize_rows(formats.quantize_rows(at, storage, nonfinite="keep"), storage, 32)
    assert not np.isfinite(bad).all()


# -- conversions on real-shaped rows ------------------------------------------------


def real_rows(seed: int = 0) -> np.ndarray:
    x = massive_rows(np.random.default_rng(seed), 24, DIM)
    x[5, 17] = np.float32(6.0e5)  # above q4_0's 524,160: its block scale overflows
    x[9, 3] = np.float32(9.0e6)  # above q8_0's 8,321,040
    return x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("storage", formats.STORAGES)
def test_error_names_the_first_unencodable_value(storage: str, dtype: str, path: str) -> None:
    x = real_rows()
    with np.errstate(over="ignore"):
        xin = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    wide = xin.astype(np.float32)
    limit = HAND_LIMITS[storage]
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~(np.abs(wide) < limit))
    with formats.simd_path(path):
        if bad.size == 0:
            formats.quantize_rows(xin, storage)
            return
        r, c = divmod(int(bad[0]), DIM)
        with pytest.raises(ValueError, match=rf"row {r}, column {c} holds "):
            formats.quantize_rows(xin, storage)
    with pytest.raises(ValueError, match=rf"row {r}, column {c}"):
        ref.encode(xin, storage, "error")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", ["zero", "clamp", "clamp_f16"])
@pytest.mark.parametrize("storage", formats.STORAGES)
def test_policies_match_the_reference_and_stay_finite(storage: str, policy: str, path: str) -> None:
    x = real_rows(1)
    x[2, 40] = np.nan
    x[3, 41] = -np.inf
    with formats.simd_path(path):
        got = formats.quantize_rows(x, storage, nonfinite=policy)
    want = ref.encode(x, storage, policy)
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()
    back = formats.dequantize_rows(got, storage, DIM)
    assert np.isfinite(back).all()
    if policy == "clamp":
        # The massive values are kept as large as the storage allows, not zeroed.
        assert np.abs(back[0]).max() >= min(MASSIVE_PEAK, 65504.0) * 0.99


def test_clamp_keeps_f16_rows_with_massive_channels_at_65504() -> None:
    x = np.array([[MASSIVE_PEAK, -1e6, 1.5, np.nan]], np.float32)
    h = formats.quantize_rows(x, "f16", nonfinite="clamp")
    assert h.astype(np.float32).tolist() == [[65504.0, -65504.0, 1.5, 0.0]]
    z = formats.quantize_rows(x, "f16", nonfinite="zero")
    assert z.astype(np.float32).tolist() == [[0.0, 0.0, 1.5, 0.0]]
    # bf16 carries them (that is why it is the storage to pick for such models).
    b = formats.quantize_rows(x[:, :3], "bf16")
    assert b.astype(np.float32)[0, 0] == pytest.approx(MASSIVE_PEAK, rel=1 / 128)


# -- the Stager ---------------------------------------------------------------------


def test_f16_storage_rejects_a_massive_channel_naming_everything(make_stager) -> None:
    st = make_stager(feature_dim=64, block_size=4, window=32, storage="f16")
    rows = feature_rows(range(3), 64)
    rows[1, 17] = MASSIVE_PEAK
    with pytest.raises(ValueError) as err:
        st.process(0, np.arange(3), rows)
    msg = str(err.value)
    assert "sequence 0: row 1 (position 1), channel 17 holds 87929" in msg
    assert "nothing was appended" in msg
    assert st.state(0)["started"] is False and st.stats(0)["rows"] == 0
    if make_stager.kind == "core":
        assert 'storage="bf16"' in msg and 'nonfinite="clamp"' in msg


@pytest.mark.parametrize("storage", ["f32", "bf16", "q8_0", "q4_0"])
def test_wider_storages_carry_massive_channels(make_stager, storage: str) -> None:
    st = make_stager(feature_dim=64, block_size=4, window=32, storage=storage)
    rows = massive_rows(np.random.default_rng(3), 8, 64)
    st.process(0, np.arange(8), rows)
    plan = st.draft(0, 8)
    assert np.isfinite(plan.rows).all()
    assert np.abs(plan.rows).max() > 65504.0


@pytest.mark.parametrize("storage", ["f32", "bf16", "q8_0", "q4_0"])
def test_staging_as_float16_is_checked_too(make_stager, storage: str) -> None:
    """f32 rows staged as float16 would hand +inf to the drafter: rejected, or clamped."""
    rows = massive_rows(np.random.default_rng(4), 6, 64)
    st = make_stager(feature_dim=64, block_size=4, window=32, storage=storage, stage_dtype="float16")
    with pytest.raises(ValueError, match=r"row 0 \(position 0\), channel \d+ holds"):
        st.process(0, np.arange(6), rows)
    clamped = make_stager(feature_dim=64, block_size=4, window=32, storage=storage, stage_dtype="float16",
                          nonfinite="clamp")
    clamped.process(0, np.arange(6), rows)
    plan = clamped.draft(0, 6)
    assert plan.rows.dtype == np.float16 and np.isfinite(plan.rows.astype(np.float32)).all()


def test_process_encoded_rejects_rows_that_overflow_the_stage_dtype(make_stager) -> None:
    cfg = StagerConfig(feature_dim=64, block_size=4, window=32, storage="q8_0", stage_dtype="float16")
    st = make_stager(cfg)
    rows = massive_rows(np.random.default_rng(5), 4, 64)
    enc = formats.quantize_rows(rows, "q8_0")  # finite q8_0, but > 65504 once decoded
    with pytest.raises(ValueError, match=r"row 0 \(position 0\), channel"):
        st.process_encoded(0, np.arange(4), enc)
    assert st.state(0)["started"] is False


@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("policy", ["zero", "clamp", "clamp_f16"])
def test_core_and_reference_stage_the_same_policed_rows(storage: str, policy: str) -> None:
    from dspark_core import Stager
    from dspark_core.reference import ReferenceStager

    cfg = StagerConfig(feature_dim=DIM, block_size=4, window=64, storage=storage, nonfinite=policy)
    rows = real_rows(2)
    rows[1, 1] = np.nan
    plans = []
    for cls in (Stager, ReferenceStager):
        st = cls(cfg)
        st.process(0, np.arange(len(rows)), rows)
        plans.append(st.draft(0, len(rows)))
    assert plans[0].encoded_rows.tobytes() == plans[1].encoded_rows.tobytes()
    assert np.isfinite(plans[0].rows).all()
