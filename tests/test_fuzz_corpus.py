"""Replay the fuzz seed corpus and every recorded finding through the fuzz targets.

Every file in ``tests/fuzz_corpus/{ops,snapshot,decode}/`` must pass its target
(``dspark_core.testing.fuzz``); files in ``tests/fuzz_corpus/findings/<target>/`` are
reproducers of bugs the fuzzers found: those listed in ``findings/KNOWN_OPEN``
must still fail (strict xfail, so a fix is noticed), all others must pass. So
every finding becomes a regression test.

Also checks that the harness can fail: the differential runner and the
invariant checker must catch deliberately broken stagers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.testing.fuzz import TARGETS
from dspark_core.reference import ReferenceStager
from dspark_core.stager.stage_plan import StagePlan
from dspark_core.testing import (
    Desync, InvariantChecker, InvariantViolation, Op, check_invariants, decode_ops, encode_ops, run_differential,
)

HERE = os.path.join(os.path.dirname(__file__), "fuzz_corpus")


def _known_open() -> set[str]:
    path = os.path.join(HERE, "findings", "KNOWN_OPEN")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def _cases():
    known = _known_open()
    for target in sorted(TARGETS):
        for sub in (target, os.path.join("findings", target)):
            d = os.path.join(HERE, sub)
            if not os.path.isdir(d):
                continue
            for name in sorted(os.listdir(d)):
                key = f"{target}/{name}"
                marks = []
                if sub != target and key in known:
                    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"open finding {key}")]
                yield pytest.param(target, os.path.join(d, name), id=f"{sub}/{name}", marks=marks)


@pytest.mark.parametrize("target, path", list(_cases()))
def test_replay(target, path):
    with open(path, "rb") as f:
        data = f.read()
    TARGETS[target](data)


def test_corpus_is_not_empty():
    for target in TARGETS:
        assert len(os.listdir(os.path.join(HERE, target))) >= 20, target


# -- the decoder -----------------------------------------------------------------


def test_decode_is_total_and_deterministic():
    for data in (b"", b"\x00", bytes(range(256)), b"\xff" * 100):
        a = decode_ops(data)
        b = decode_ops(data)
        assert a == b
    cfg, ops = decode_ops(bytes(range(5)) + bytes(6 * 200))
    assert len(ops) == 64


def test_one_byte_changes_one_op():
    data = bytearray(bytes(range(5)) + bytes((i * 37) % 256 for i in range(6 * 10)))
    _, ops = decode_ops(bytes(data))
    data[5 + 6 * 4 + 2] ^= 0x10  # an argument byte of op 4
    _, ops2 = decode_ops(bytes(data))
    assert [i for i, (a, b) in enumerate(zip(ops, ops2)) if a != b] == [4]


def test_encode_ops_round_trip():
    cfg = StagerConfig(64, 3, 20, max_seqs=2, storage="q4_0", stage_dtype="bfloat16", nonfinite="zero")
    data = encode_ops(cfg, [("process", b"\0\x05"), ("round", b"\0"), ("snapshot", b"\x01")])
    cfg2, ops = decode_ops(data)
    assert cfg2 == cfg
    assert [o.name for o in ops] == ["process", "round", "snapshot"]
    assert "process(" in repr(ops[0])


# -- the harness must be able to fail -------------------------------------------------


class _ShiftedPlans:
    """A stager whose plans put context rows one drafter position too far."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _shift(self, p):
        if p.skip is not None:
            return p
        return StagePlan(seq=p.seq, start=p.start, skip=None, rebase=p.rebase, clear_cache=p.clear_cache,
                         positions=(p.positions + 1).astype(np.int32), block_positions=p.block_positions,
                         crop_from=p.crop_from, pos_base=p.pos_base, encoded_rows=p.encoded_rows, rows=p.rows)

    def draft(self, seq, n_past):
        return self._shift(self._inner.draft(seq, n_past))


class _NeverClears(_ShiftedPlans):
    """A stager that never tells the server to clear the drafter cache (after a rebase)."""

    def _shift(self, p):
        if p.skip is not None or not p.clear_cache or p.start == p.crop_from:
            return p
        return StagePlan(seq=p.seq, start=p.start, skip=None, rebase=False, clear_cache=False,
                         positions=p.positions, block_positions=p.block_positions, crop_from=p.crop_from,
                         pos_base=p.pos_base, encoded_rows=p.encoded_rows, rows=p.rows)


class _StaleRows(_ShiftedPlans):
    """A stager that stages the first row twice (wrong content, right shape)."""

    def _shift(self, p):
        if p.skip is not None or p.n_rows < 2:
            return p
        enc = p.encoded_rows.copy()
        enc[1] = enc[0]
        return StagePlan(seq=p.seq, start=p.start, skip=None, rebase=p.rebase, clear_cache=p.clear_cache,
                         positions=p.positions, block_positions=p.block_positions, crop_from=p.crop_from,
                         pos_base=p.pos_base, encoded_rows=enc, rows=None, decode=lambda e: p.rows)


class _CommitLeavesOpen(_ShiftedPlans):
    """commit() that does nothing: the round stays open."""

    def _shift(self, p):
        return p

    def commit(self, seq):
        pass


def _drive(st, cfg, rounds=12):
    rng = np.random.default_rng(0)
    st.process(0, np.arange(3 * cfg.window), rng.standard_normal((3 * cfg.window, cfg.feature_dim)).astype(np.float32))
    for _ in range(rounds):
        end = st.state(0)["end"]
        plan = st.draft(0, end)
        if plan.skip is None:
            st.commit(0)
        n = cfg.block_size + 1
        st.process(0, np.arange(end, end + n), rng.standard_normal((n, cfg.feature_dim)).astype(np.float32))
        st.accept(0, 1)


CFG = StagerConfig(32, 4, 17)


def test_checker_passes_real_stagers():
    for cls in (Stager, ReferenceStager):
        st = InvariantChecker(cls(CFG))
        _drive(st, CFG)
        assert st.calls > 30


@pytest.mark.parametrize("broken", [_ShiftedPlans, _NeverClears, _StaleRows, _CommitLeavesOpen])
def test_checker_catches_broken_stager(broken):
    st = InvariantChecker(broken(Stager(CFG)), CFG)
    with pytest.raises(InvariantViolation):
        _drive(st, CFG)


@pytest.mark.parametrize("broken", [_ShiftedPlans, _NeverClears, _StaleRows])
def test_differential_runner_catches_broken_core(broken):
    ops = [Op("long_prefill", (("seq", 0), ("n", "2w+3"), ("chunks", 1), ("seed", 1))),
           Op("round", (("seq", 0), ("close", "commit"), ("n_verify", 0), ("accepted", 1), ("rounds", 6),
                        ("seed", 1)))]
    run_differential(CFG, ops)  # the real core passes
    with pytest.raises(Desync) as info:
        run_differential(CFG, ops, core=broken(Stager(CFG)))
    assert "op trace" in str(info.value) and "draft(" in str(info.value)


def test_check_invariants_catches_bad_state():
    class BadState:
        def __init__(self, inner):
            self._inner = inner

        def state(self, seq):
            s = dict(self._inner.state(seq))
            s["horizon"] = s["end"] + 1
            return s

        def stats(self, seq):
            return self._inner.stats(seq)

    st = Stager(CFG)
    st.process(0, np.arange(5), np.ones((5, 32), np.float32))
    check_invariants(st, CFG)
    with pytest.raises(InvariantViolation):
        check_invariants(BadState(st), CFG)


def test_float_edge_dictionary_is_libfuzzer_syntax():
    """Each line is ``name="<\\xNN escapes>"`` and decodes to the pattern's little-endian bytes."""
    import codecs
    import re

    from dspark_core.testing.fuzz import FLOAT_EDGE_BITS, float_edge_dictionary

    lines = float_edge_dictionary().splitlines()
    assert len(lines) == len(FLOAT_EDGE_BITS)
    for line, (value, width) in zip(lines, FLOAT_EDGE_BITS):
        m = re.fullmatch(r'[A-Za-z0-9_]+="((?:\\x[0-9a-f]{2})+)"', line)
        assert m, line
        assert codecs.escape_decode(m.group(1))[0] == value.to_bytes(width, "little")
    # The pattern behind the f32 -> f16 finding (findings/decode/f32-snan-low-payload-to-float16).
    assert (0x7F800001, 4) in FLOAT_EDGE_BITS


def test_decode_target_catches_a_wrong_f16_nan_rule(monkeypatch):
    """The decode target fails when the oracle's f32 -> f16 NaN rule differs from the core's."""
    from dspark_core.reference import formats as reference_formats

    with open(os.path.join(HERE, "findings", "decode", "f32-snan-low-payload-to-float16"), "rb") as f:
        data = f.read()
    TARGETS["decode"](data)
    monkeypatch.setattr(reference_formats, "_f16", lambda x: x.astype(np.float16))
    with pytest.raises(AssertionError, match="float16"):
        TARGETS["decode"](data)
