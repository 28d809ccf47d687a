"""Bad input: a clear exception, and nothing changed (core and reference alike)."""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest
from conftest import feature_rows

from dspark_core import ConfigError, StagerConfig, StateError

D, B, W = 32, 4, 12


@pytest.fixture
def primed(make_stager):
    """A sequence with a committed round and a pending verify batch."""
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st.process(0, np.arange(6), feature_rows(range(6), D))
    st.draft(0, 6)
    st.commit(0)
    st.process(0, np.arange(6, 11), feature_rows(range(6, 11), D))
    return st


def frozen(st, seq=0):
    """Everything observable about a sequence."""
    return st.state(seq), st.stats(seq), st.snapshot(seq)


BAD_PROCESS = [
    ("wrong width", lambda: (np.arange(11, 13), feature_rows([11, 12], D)[:, :-1]), ValueError, r"shape \(n, 32\)"),
    ("wrong dtype", lambda: (np.arange(11, 13), feature_rows([11, 12], D).astype(np.float64)), TypeError, "float32, float16 or bfloat16"),
    ("int rows", lambda: (np.arange(11, 13), np.ones((2, D), np.int32)), TypeError, "float32"),
    ("list rows", lambda: (np.arange(11, 13), [[0.0] * D] * 2), TypeError, "numpy array"),
    ("1-D rows", lambda: (np.arange(11, 12), feature_rows([11], D)[0]), ValueError, "shape"),
    ("float positions", lambda: (np.array([11.0, 12.0]), feature_rows([11, 12], D)), TypeError, "integers"),
    ("2-D positions", lambda: (np.array([[11, 12]]), feature_rows([11, 12], D)), ValueError, "1-D"),
    ("count mismatch", lambda: (np.arange(11, 14), feature_rows([11, 12], D)), ValueError, "3 positions for 2 rows"),
    ("negative", lambda: (np.array([-1, 0]), feature_rows([0, 1], D)), ValueError, "out of range"),
    ("gap", lambda: (np.array([11, 13]), feature_rows([11, 12], D)), ValueError, "contiguous"),
    ("backwards", lambda: (np.array([12, 11]), feature_rows([11, 12], D)), ValueError, "contiguous"),
    ("not continuing", lambda: (np.arange(12, 14), feature_rows([12, 13], D)), ValueError, "continue at 11"),
    ("huge", lambda: (np.array([2**62]), feature_rows([0], D)), ValueError, "out of range"),
]


@pytest.mark.parametrize("name,make,exc,match", BAD_PROCESS, ids=[b[0] for b in BAD_PROCESS])
def test_bad_process_changes_nothing(primed, name, make, exc, match):
    before = frozen(primed)
    positions, rows = make()
    with pytest.raises(exc, match=match):
        primed.process(0, positions, rows)
    assert frozen(primed) == before


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nonfinite_row_names_sequence_row_and_position(primed, bad, dtype):
    rows = feature_rows(range(11, 15), D)
    rows[2, 5] = bad
    rows = rows.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    before = frozen(primed)
    with pytest.raises(ValueError, match=r"sequence 0: row 2 \(position 13\), channel 5 holds -?(nan|inf)\b.*nothing was appended"):
        primed.process(0, np.arange(11, 15), rows)
    assert frozen(primed) == before


def test_nonfinite_in_a_long_prefill_is_atomic(make_stager):
    """A chunk far longer than the window is checked whole before any row goes."""
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(20), feature_rows(range(20), D))
    before = frozen(st)
    rows = feature_rows(range(20, 900), D)
    rows[3, 0] = np.nan  # far below the window: would be skipped, still rejected
    with pytest.raises(ValueError, match=r"row 3 \(position 23\)"):
        st.process(0, np.arange(20, 900), rows)
    assert frozen(st) == before
    rows[3, 0] = 0
    rows[-1, 0] = np.inf  # inside the window
    with pytest.raises(ValueError, match=r"row 879 \(position 899\)"):
        st.process(0, np.arange(20, 900), rows)
    assert frozen(st) == before


@pytest.mark.parametrize("policy", ["zero", "clamp_f16"])
def test_nonfinite_policies_store_something_finite(make_stager, policy):
    st = make_stager(feature_dim=D, block_size=B, window=W, nonfinite=policy)
    rows = feature_rows(range(3), D)
    rows[0, 0], rows[1, 1], rows[2, 2] = np.nan, np.inf, 1e6
    st.process(0, np.arange(3), rows)
    plan = st.draft(0, 3)
    assert plan.rows[0, 0] == 0
    assert plan.rows[1, 1] == (0 if policy == "zero" else 65504)
    assert plan.rows[2, 2] == (1e6 if policy == "zero" else 65504)


def test_unknown_sequence_is_a_value_error(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2)
    calls = [
        lambda s: st.begin(s),
        lambda s: st.process(s, [0], feature_rows([0], D)),
        lambda s: st.draft(s, 1),
        lambda s: st.commit(s),
        lambda s: st.fail(s),
        lambda s: st.accept(s, 0),
        lambda s: st.rollback(s, 0),
        lambda s: st.shift(s, 0, 1),
        lambda s: st.snapshot(s),
        lambda s: st.state(s),
        lambda s: st.stats(s),
        lambda s: st.fork(s, 0),
    ]
    for call in calls:
        for bad in (-1, 2, 2**70):
            with pytest.raises(ValueError, match="unknown sequence"):
                call(bad)
        with pytest.raises(TypeError, match="must be an integer"):
            call(1.5)
    # A batch's ids are one integer array: an id is unknown (one beyond int64 clamped, as the
    # per-sequence calls clamp theirs), or the array is not integers.
    for bad, named in ((-1, -1), (2, 2), (np.iinfo(np.int64).max, 2**63 - 1), (2**70, 2**63 - 1)):
        with pytest.raises(ValueError, match=rf"draft_many: seqs\[1\] \(sequence {named}\): unknown sequence"):
            st.draft_many([0, bad], [1, 1])
    for bad in (1.5, None):
        with pytest.raises(TypeError, match="draft_many: seqs must be integers"):
            st.draft_many([0, bad], [1, 1])


def test_open_round_allows_only_commit_and_fail(primed):
    primed.accept(0, 4)
    plan = primed.draft(0, 11)
    assert plan.skip is None
    before = primed.state(0)
    # StateError comes before the other arguments are looked at: even bad ones.
    for call in [
        lambda: primed.begin(0),
        lambda: primed.process(0, "not positions", None),
        lambda: primed.process_encoded(0, [11], b"x"),
        lambda: primed.draft(0, -5),
        lambda: primed.draft_many([1, 0], [0, 0]),
        lambda: primed.accept(0, 99),
        lambda: primed.rollback(0, -1),
        lambda: primed.shift(0, -1, -1),
        lambda: primed.fork(0, 1),
        lambda: primed.fork(1, 0),
        lambda: primed.snapshot(0),
        lambda: primed.restore(0, b"junk"),
    ]:
        with pytest.raises(StateError, match="open round"):
            call()
    assert primed.state(0) == before
    with pytest.raises(ValueError, match="stage must be one of"):
        primed.fail(0, "bogus")
    assert primed.state(0) == before
    primed.commit(0)
    with pytest.raises(StateError, match="no open round"):
        primed.commit(0)
    with pytest.raises(StateError, match="no open round"):
        primed.fail(0, "decode")


def test_bad_values(primed):
    before = frozen(primed)
    with pytest.raises(ValueError, match=r"n_accepted must be in \[0, 4\]"):
        primed.accept(0, 5)
    with pytest.raises(ValueError, match=r"n_accepted must be in \[0, 4\]"):
        primed.accept(0, -1)
    with pytest.raises(ValueError, match="n_past"):
        primed.draft(0, -1)
    with pytest.raises(ValueError, match="n_past"):
        primed.draft(0, 2**63)
    with pytest.raises(TypeError, match="n_past must be an integer"):
        primed.draft(0, 3.0)
    with pytest.raises(ValueError, match="n_past"):
        primed.rollback(0, -2)
    with pytest.raises(ValueError, match="n_keep"):
        primed.shift(0, -1, 1)
    with pytest.raises(ValueError, match="reaches past the end"):
        primed.shift(0, 5, 7)
    with pytest.raises(ValueError, match="two different sequences"):
        primed.fork(0, 0)
    with pytest.raises(ValueError, match=r"sequence 0 appears twice \(seqs\[0\] and seqs\[1\]\)"):
        primed.draft_many([0, 0], [11, 11])
    with pytest.raises(ValueError, match="2 sequences for 1"):
        primed.draft_many([0, 1], [11])
    with pytest.raises(TypeError, match="bytes-like"):
        primed.restore(0, 12345)
    assert frozen(primed) == before


def test_config_errors():
    with pytest.raises(ConfigError, match=r"window \(8\) must be greater than 2 \* block_size \(2 \* 4 = 8\)"):
        StagerConfig(D, 4, 8)
    with pytest.raises(ConfigError, match="feature_dim % 32"):
        StagerConfig(33, 4, 20, storage="q8_0")
    with pytest.raises(ConfigError, match="storage"):
        StagerConfig(32, 4, 20, storage="q5_1")
    with pytest.raises(ConfigError, match="stage_dtype"):
        StagerConfig(32, 4, 20, stage_dtype="float64")
    with pytest.raises(ConfigError, match="nonfinite"):
        StagerConfig(32, 4, 20, nonfinite="ignore")
    with pytest.raises(ConfigError, match="max_seqs"):
        StagerConfig(32, 4, 20, max_seqs=0)
    assert issubclass(ConfigError, ValueError) and issubclass(StateError, RuntimeError)
    # from_limits: min(n_ctx_train, n_batch), lowered by the cap, never raised.
    assert StagerConfig.from_limits(32, 16, 4096, 2048).window == 2048
    assert StagerConfig.from_limits(32, 16, 4096, 8192).window == 4096
    assert StagerConfig.from_limits(32, 16, 4096, 8192, cap=1000).window == 1000
    assert StagerConfig.from_limits(32, 16, 4096, 8192, cap=100000).window == 4096
    with pytest.raises(ConfigError, match=r"window \(32\) must be greater than 2 \* block_size \(2 \* 16 = 32\)"):
        StagerConfig.from_limits(32, 16, 4096, 32)


def test_stager_rejects_non_config(make_stager):
    from dspark_core import Stager
    from dspark_core.reference import ReferenceStager

    for cls in (Stager, ReferenceStager):
        with pytest.raises(TypeError, match="StagerConfig"):
            cls({"feature_dim": 32})


def test_core_config_check_never_aborts():
    """The C++ constructor re-checks W > 2B itself (it never trusts Python): ConfigError, not an abort."""
    from dspark_core import Stager

    cfg = StagerConfig(D, B, W)
    object.__setattr__(cfg, "window", 2 * B)  # bypass the Python-side validation
    with pytest.raises(ConfigError, match=r"window \(8\) must be greater than 2 \* block_size"):
        Stager(cfg)


def test_accept_without_a_draft_is_a_noop(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(5), feature_rows(range(5), D))
    st.accept(0, 0)  # no draft since begin: prompt rows are final
    assert st.state(0)["end"] == 5
    st.draft(0, 5)
    st.commit(0)
    st.accept(0, 0)  # no rows since the draft
    assert st.state(0)["end"] == 5


def test_disable_after_max_failures_warns_once(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_failures=2)
    st.process(0, np.arange(5), feature_rows(range(5), D))
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        for k in range(2):
            plan = st.draft(0, 5 + k)
            assert plan.skip is None and plan.rebase == (k > 0)
            st.fail(0, "decode" if k == 0 else "crop")
            st.process(0, [5 + k], feature_rows([5 + k], D))
        for _ in range(3):
            assert st.draft(0, 7).skip == "disabled"
    warnings = [r for r in caplog.records if r.name == "dspark_core" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "sequence 0: drafting disabled after 2 consecutive drafter failures (last: crop)" in warnings[0].getMessage()
    assert st.state(0)["disabled"]
    st.begin(0)  # re-enables
    assert not st.state(0)["disabled"]
    st.process(0, np.arange(3), feature_rows(range(3), D))
    assert st.draft(0, 3).skip is None


def test_a_commit_resets_the_failure_count(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_failures=2)
    st.process(0, np.arange(5), feature_rows(range(5), D))
    n = 5
    for k in range(6):  # fail, commit, fail, commit ...: never two in a row
        st.draft(0, n)
        st.fail(0) if k % 2 == 0 else st.commit(0)
        st.process(0, [n], feature_rows([n], D))
        n += 1
    assert not st.state(0)["disabled"]
    assert st.stats(0)["failures"] == 3


def test_fail_keeps_the_retained_rows(make_stager):
    """After a failed rebase the next round restages the same window (not a soft skip forever)."""
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(30), feature_rows(range(30), D))
    first = st.draft(0, 30)
    assert first.rebase and first.n_rows == W // 2
    st.fail(0, "decode")
    st.process(0, [30], feature_rows([30], D))
    again = st.draft(0, 31)
    assert again.skip is None and again.rebase and again.clear_cache
    np.testing.assert_array_equal(again.rows, feature_rows(range(31 - W // 2, 31), D))


def test_skip_reasons_in_order(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_failures=1)
    assert st.draft(0, 0).skip == "empty"
    assert st.draft(0, 5).skip == "empty"
    st.process(0, np.arange(3, 8), feature_rows(range(3, 8), D))  # origin p0 = 3
    before = (st.state(0), st.snapshot(0))
    assert st.draft(0, 3).skip == "no_context"  # start <= n_cache (= p0)
    assert st.draft(0, 7).skip == "missing_rows"
    assert st.draft(0, 9).skip == "missing_rows"
    assert (st.state(0), st.snapshot(0)) == before  # a skip changes no state and opens no round
    assert st.stats(0)["skips"] == 5 and st.stats(0)["rounds"] == 0
    plan = st.draft(0, 8)
    assert plan.skip is None and plan.pos_base == 3 and list(plan.positions) == [0, 1, 2, 3, 4]
    st.fail(0)
    assert st.draft(0, 8).skip == "disabled"
    skip = st.draft(0, 1)
    assert skip.skip == "disabled" and skip.crop_from == -1 and skip.rows.shape == (0, D)
    assert not st.state(0)["open_round"]


def test_config_bounds_are_config_errors():
    """Sizes the core cannot represent are rejected up front, on both sides."""
    from dspark_core import Stager

    with pytest.raises(ConfigError, match=r"window \(1073741825\) must be <= 2\*\*30"):
        StagerConfig(32, 4, 2**30 + 1)
    with pytest.raises(ConfigError, match=r"feature_dim .* must be <= 2\*\*28"):
        StagerConfig(2**28 + 32, 4, 20)
    cfg = StagerConfig(32, 4, 20)
    object.__setattr__(cfg, "window", 2**55)  # bypass Python: the core checks on its own
    with pytest.raises(ConfigError, match="must be <= 2\\*\\*30"):
        Stager(cfg)
    big = StagerConfig(2**28, 4, 2**30)  # representable: reserved lazily, nothing allocated yet
    assert Stager(big).stats(0)["reserved_bytes"] == 0


def test_disable_warning_counts_restored_failures(make_stager, caplog):
    """The warning names the real consecutive-failure count (e.g. carried in by a snapshot)."""
    a = make_stager(feature_dim=D, block_size=B, window=W, max_failures=5)
    a.process(0, np.arange(5), feature_rows(range(5), D))
    for k in range(4):
        a.draft(0, 5 + k)
        a.fail(0)
        a.process(0, [5 + k], feature_rows([5 + k], D))
    b = make_stager(feature_dim=D, block_size=B, window=W, max_failures=2)
    b.restore(0, a.snapshot(0))
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        b.draft(0, 9)
        b.fail(0, "crop")
    msgs = [r.getMessage() for r in caplog.records if r.name == "dspark_core"]
    assert msgs == [
        "sequence 0: drafting disabled after 5 consecutive drafter failures (last: crop); begin() re-enables it"
    ]


@pytest.mark.parametrize("variant", ["big-endian", "strided", "lists", "int32 positions", "fortran"])
def test_every_array_layout_stages_the_same_rows(make_stager, variant):
    """The binding's fast path (C-contiguous native int64 / float32) and its general
    path (anything else array-like) store exactly the same rows."""
    rows = feature_rows(range(6), D)
    pos = np.arange(6)
    if variant == "big-endian":
        args = (pos.astype(">i8"), rows.astype(">f4"))
    elif variant == "strided":
        wide = np.zeros((6, 2 * D), np.float32)
        wide[:, ::2] = rows
        args = (np.arange(0, 12)[::2] // 2, wide[:, ::2])
    elif variant == "lists":
        args = (list(range(6)), rows)
    elif variant == "int32 positions":
        args = (pos.astype(np.int32), rows)
    else:
        args = (pos, np.asfortranarray(rows))
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, *args)
    plan = st.draft(0, 6)
    np.testing.assert_array_equal(plan.rows, rows)
    assert plan.rows.dtype == np.float32 and plan.rows.dtype.isnative


def test_the_cores_limits_reach_python_at_their_boundary():
    """Python reads its limits from the core and leaves the checks to it: the boundary is
    exact (a stale copy of a limit on either side breaks one of the two sides)."""
    from dspark_core import Stager
    from dspark_core.stager import core_tables

    assert StagerConfig(32, 4, 20, max_seqs=core_tables.MAX_SEQS_LIMIT).max_seqs == core_tables.MAX_SEQS_LIMIT
    with pytest.raises(ConfigError, match=rf"max_seqs \({core_tables.MAX_SEQS_LIMIT + 1}\) exceeds the limit"):
        StagerConfig(32, 4, 20, max_seqs=core_tables.MAX_SEQS_LIMIT + 1)
    assert StagerConfig(32, 4, core_tables.MAX_WINDOW).window == core_tables.MAX_WINDOW
    with pytest.raises(ConfigError, match=r"must be <= 2\*\*30"):
        StagerConfig(32, 4, core_tables.MAX_WINDOW + 1)
    # A tampered config (a pickle bypasses __post_init__) meets the same check in the core.
    cfg = StagerConfig(32, 4, 20)
    object.__setattr__(cfg, "max_seqs", 200_000)
    with pytest.raises(ConfigError, match=rf"max_seqs \(200000\) exceeds the limit {core_tables.MAX_SEQS_LIMIT}"):
        Stager(cfg)
    object.__setattr__(cfg, "max_seqs", 2**70)  # beyond int64: clamped, still refused
    with pytest.raises(ConfigError, match="exceeds the limit"):
        Stager(cfg)


def test_a_conversion_error_comes_after_the_sequence_checks(make_stager):
    """docs/design.md 2.1: an unknown sequence, then its round state, then the arguments
    (their kind first): the binding's own conversions respect that order."""
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2)
    for call in (lambda: st.accept(5, 1.5), lambda: st.draft(5, "x"), lambda: st.process(5, [0.5], None),
                 lambda: st.draft_many([0, 5], [1]), lambda: st.fail(5, 3), lambda: st.restore(5, 12345),
                 lambda: st.check_process(5, [0.5])):
        with pytest.raises(ValueError, match="unknown sequence 5"):
            call()
    with pytest.raises(StateError, match="no open round"):
        st.fail(0, 3)
    with pytest.raises(ValueError, match=r"stage must be one of \('decode', 'crop'\), got 3"):
        st.process(0, [0], feature_rows([0], D))
        st.draft(0, 1)
        st.fail(0, 3)
