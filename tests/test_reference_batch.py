"""The reference twin's batched calls: each equals its per-sequence calls, checked whole.

Three kinds of test:

* fixed cases: the order of a batch's checks and the words of its errors
  (``<call>: seqs[i] (sequence s): <the per-sequence error>``), reservations
  (during one every call but confirm / cancel / end is a StateError; cancel
  puts the sequence back exactly; confirm is process), ``end`` in any state;
* a hypothesis driver of random batches, mostly valid and some not, run
  batched on one reference and call by call on another (both row modes): the
  same results, logs and state after every batch; a rejected batch changes
  nothing, and its error about ``seqs[i]`` is what the per-sequence call on
  ``seqs[i]`` raises;
* the same driver on the C++ core and the reference: the same results, state
  and error messages, call for call.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from conftest import massive_rows
from hypothesis import Phase, given, settings
from hypothesis import strategies as hst

from dspark_core import Stager, StagerConfig
from dspark_core.errors import StateError
from dspark_core.reference import SEMANTIC_STATS, ReferenceStager
from dspark_core.reference.batch_plan import pad_rows, paged_rows

D, B, W, N_SEQS = 32, 4, 48, 5

#: The core's Python API has the batched calls (the binding of this branch).
CORE_HAS_BATCHES = all(hasattr(Stager, m) for m in (
    "process_many", "accept_many", "commit_many", "fail_many", "end", "end_many", "reserve", "reserve_many",
    "confirm", "cancel", "confirm_many", "cancel_many", "open_round_ids", "draft_many"))


def config(rows: str = "held", **kw: Any) -> StagerConfig:
    base: dict[str, Any] = dict(feature_dim=D, block_size=B, window=W, max_seqs=N_SEQS, max_failures=2,
                                storage="bf16", rows=rows)
    base.update(kw)
    return StagerConfig(**base)


def rows_at(n: int, seed: int = 0) -> np.ndarray:
    return massive_rows(np.random.default_rng(seed), n, D)


def digest(stg: Any) -> list[Any]:
    """Everything observable of a Stager's sequences (state, counters, slots, snapshot)."""
    out: list[Any] = [stg.moves_issued]
    for s in range(stg.config.max_seqs):
        state = stg.state(s)
        stats = stg.stats(s)
        busy = state["open_round"] or state["reservation_open"]
        out.append((state, {k: stats[k] for k in SEMANTIC_STATS}, stg.live_slots(s).tolist(),
                    stg.open_round_id(s), None if busy else stg.snapshot(s)))
    return out


def raised(fn: Callable[..., Any], *args: Any) -> BaseException:
    try:
        fn(*args)
    except (ValueError, TypeError, StateError) as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args!r} did not raise")


@contextmanager
def captured_logs() -> Iterator[list[str]]:
    got: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    log = logging.getLogger("dspark_core")
    sink = Sink()
    log.addHandler(sink)
    try:
        yield got
    finally:
        log.removeHandler(sink)


def started(stg: Any, seq: int, n: int = 6, p0: int = 0) -> np.ndarray | None:
    """Give ``seq`` ``n`` rows from ``p0``; the slots in external mode."""
    pos = np.arange(p0, p0 + n)
    return stg.process(seq, pos) if stg.config.external_rows else stg.process(seq, pos, rows_at(n, seq))


# -- the order of a batch's checks and the words of its errors ------------------------------


def test_batch_errors_name_the_sequence_in_the_order_of_the_checks():
    ref = ReferenceStager(config())
    for s in range(3):
        started(ref, s)
    ref.draft(1, 6)  # sequence 1 has an open round
    prefix = "accept_many: seqs[{}] (sequence {}): "
    cases: list[tuple[tuple[Any, ...], type, str]] = [
        # 1. every id, before any state
        (([1, 7], [0, 0]), ValueError, prefix.format(1, 7) + "unknown sequence 7 (this Stager has sequences 0..4)"),
        # 2. every state, before the arrays' kinds
        (([0, 1], "x"), StateError,
         prefix.format(1, 1) + "sequence 1 has an open round: call commit() or fail() first"),
        # 3. the arrays' kinds and shapes, before unique ids
        (([0, 0], [1]), ValueError, "accept_many: 2 sequences for 1 n_accepted values"),
        (([0, 2], [1.5, 0]), TypeError, "accept_many: n_accepted must be integers, got dtype float64"),
        (([0, 2], [[1, 0]]), ValueError, "accept_many: n_accepted must be 1-D, got shape (1, 2)"),
        (([0.0, 2.0], [1, 0]), TypeError, "accept_many: seqs must be integers, got dtype float64"),
        # 4. unique ids, then the values sequence by sequence
        (([0, 2, 0], [9, 9, 9]), ValueError,
         "accept_many: sequence 0 appears twice (seqs[0] and seqs[2]): a batch names each sequence once"),
        (([2, 0], [1, 9]), ValueError, prefix.format(1, 0) + "n_accepted must be in [0, 4], got 9"),
    ]
    before = digest(ref)
    for args, kind, message in cases:
        exc = raised(ref.accept_many, *args)
        assert type(exc) is kind and str(exc) == message, (args, exc)
        assert digest(ref) == before


def test_process_many_checks_positions_of_every_sequence_before_any_rows():
    ref = ReferenceStager(config(storage="f16"))  # f16 storage cannot hold a massive activation
    rows = rows_at(4)  # row 0 (sequence 0's) overflows f16
    ref.process(1, [0, 1], rows_at(3)[1:3] / 1e4)
    before = digest(ref)
    # sequence 1 continues at 2, not 5: its positions are named although sequence 0's rows come first
    exc = raised(ref.process_many, [0, 1], [0, 2, 4], [0, 1, 5, 6], rows)
    assert type(exc) is ValueError
    assert str(exc) == ("process_many: seqs[1] (sequence 1): sequence 1: positions must continue at 2, got 5 "
                        "(rows 2..4 were never processed: every target decode must be passed to process())")
    exc = raised(ref.process_many, [0, 1], [0, 2, 4], [0, 1, 2, 3], rows)
    assert type(exc) is ValueError and str(exc).startswith(
        "process_many: seqs[0] (sequence 0): sequence 0: row 0 (position 0), channel ")
    assert "which overflows f16 storage (|x| must stay below 65520)" in str(exc)  # f16 rounds below 65520 to 65504
    for cu, message in (([1, 2, 4], "must start at 0, got 1"),
                        ([0, 3, 2], "must not decrease, got cu_seqlens[2] = 2 < cu_seqlens[1] = 3"),
                        ([0, 2, 3], "must end at the 4 rows, got 3")):
        exc = raised(ref.process_many, [0, 1], cu, [0, 1, 2, 3], rows)
        assert type(exc) is ValueError and str(exc) == f"process_many: cu_seqlens {message}"
    exc = raised(ref.process_many, [0, 1], [0, 2], [0, 1, 2, 3], rows)
    assert str(exc) == "process_many: cu_seqlens must have 3 entries (one more than seqs), got 2"
    exc = raised(ref.process_many, [0, 1], [0, 2, 4], [0, 1, 2, 3], rows[:3])
    assert str(exc) == "process_many: 4 positions for 3 rows"
    exc = raised(ref.process_many, [0, 1], [0, 2, 4], [0, 1, 2, 3])
    assert type(exc) is TypeError and str(exc).startswith("process_many: rows are required")
    assert digest(ref) == before
    ref.process_many([0, 1], [0, 2, 4], [0, 1, 2, 3], rows / 1e4)
    assert [ref.state(s)["end"] for s in (0, 1)] == [2, 4]


def test_fail_many_stage_errors_and_warnings():
    ref = ReferenceStager(config())
    for s in range(3):
        started(ref, s)
        ref.draft(s, 6)
    before = digest(ref)
    exc = raised(ref.fail_many, [0, 2], ["crop", "later"])
    assert type(exc) is ValueError
    assert str(exc) == "fail_many: seqs[1] (sequence 2): stage must be one of ('decode', 'crop'), got 'later'"
    assert str(raised(ref.fail_many, [0, 2], [0, 2])) == (
        "fail_many: seqs[1] (sequence 2): stage must be one of ('decode', 'crop'), got 2")
    assert str(raised(ref.fail_many, [0, 2], ["crop"])) == "fail_many: 2 sequences for 1 stages"
    assert str(raised(ref.fail_many, [0, 2], [["crop"], ["crop"]])) == (
        "fail_many: stages must be one name or 1-D, got shape (2, 1)")
    assert str(raised(ref.fail_many, [0, 3], "later")) == (
        "fail_many: seqs[1] (sequence 3): sequence 3 has no open round (call draft() first)")
    assert digest(ref) == before
    ref.fail_many([2, 0], [1, 0])  # codes: crop, decode
    ref.draft_many([0, 2], [6, 6])
    with captured_logs() as logs:
        ref.fail_many([2, 0], "crop")  # the second failure in a row disables both (max_failures=2)
    assert logs == [f"sequence {s}: drafting disabled after 2 consecutive drafter failures (last: crop); "
                    "begin() re-enables it" for s in (2, 0)]


def test_draft_many_checks_every_n_past_then_strict_mode():
    ref = ReferenceStager(config(strict=True))
    for s in range(3):
        started(ref, s)
    before = digest(ref)
    exc = raised(ref.draft_many, [0, 1, 2], [4, 6, -1])  # sequence 0 is out of protocol, 2's n_past out of range
    assert type(exc) is ValueError and str(exc) == "draft_many: seqs[2] (sequence 2): n_past must be in [0, 2**62), got -1"
    exc = raised(ref.draft_many, [1, 0, 2], [6, 4, 6])
    assert type(exc) is StateError and str(exc) == (
        "draft_many: seqs[1] (sequence 0): sequence 0: draft(n_past=4) does not match the buffered rows (newest 5): "
        "rows 4..5 are still buffered: was accept() not called after the verify batch (it keeps n_accepted + 1 of "
        "its rows), or is a rollback() to the target's n_past missing? (strict=True; nothing changed)")
    exc = raised(ref.draft_many, [1, 0, 2], [6, 6])
    assert str(exc) == "draft_many: 3 sequences for 2 n_pasts values"
    assert digest(ref) == before


def test_the_batch_plan_is_the_per_sequence_plans_laid_out_as_arrays():
    batched, single = ReferenceStager(config()), ReferenceStager(config())
    for stg in (batched, single):
        started(stg, 0, 9)
        started(stg, 3, 30)
        started(stg, 4, 2)
    bp = batched.draft_many([3, 1, 0, 4], [30, 0, 9, 0])
    plans = [single.draft(s, p) for s, p in ((3, 30), (1, 0), (0, 9), (4, 0))]
    assert bp.seqs.tolist() == [3, 1, 0, 4]
    assert bp.skip_code.tolist() == [0, 2, 0, 3]  # empty, no_context
    assert bp.skips == {1: "empty", 4: "no_context"}
    assert bp.round.tolist() == [1, 0, 2, 0] == [p.round for p in plans]
    assert bp.row_offsets.tolist() == [0, 30, 30, 39, 39]
    assert bp.positions.tolist() == list(range(30)) + list(range(9))
    assert bp.pos_base.tolist() == [0, -1, 0, -1] and bp.crop_from.tolist() == [30, -1, 9, -1]
    assert bp.block_positions[0].tolist() == [30, 31, 32, 33] and bp.block_positions[1].tolist() == [-1] * B
    for got, want in zip(bp.plans, plans):
        for name in ("seq", "start", "skip", "rebase", "clear_cache", "crop_from", "pos_base", "round"):
            assert getattr(got, name) == getattr(want, name), name
        for name in ("positions", "block_positions", "slots", "encoded_rows", "rows"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert bp.encoded_rows.tobytes() == b"".join(p.encoded_rows.tobytes() for p in plans)
    assert bp.slots.tolist() == [x for p in plans for x in p.slots.tolist()]
    pad = bp.padded(30)
    assert pad.positions.shape == (4, 30) and pad.positions[0].tolist() == list(range(30))
    assert pad.positions[2].tolist() == list(range(9)) + [-1] * 21 and (pad.slots[1] == -1).all()
    exc = raised(bp.padded, 29)
    assert type(exc) is ValueError
    assert str(exc) == "padded: seqs[0] (sequence 3): 30 context rows do not fit max_rows (29)"


def test_pad_rows_checks_the_offsets():
    out = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError, match=r"^padded: row_offsets must rise from 0 to the 3 rows$"):
        pad_rows(np.array([0, 1]), np.array([0, 2, 1]), np.arange(3), 3, out)
    assert not out.any()  # nothing written
    pad_rows(np.array([0, 1]), np.array([0, 2, 3]), np.arange(3), 3, out)
    assert out.tolist() == [[0, 1, -1], [2, -1, -1]]


@settings(max_examples=150, deadline=None, phases=[Phase.generate])
@given(counts=hst.lists(hst.integers(0, 9), min_size=0, max_size=8), width=hst.integers(0, 9),
       wide=hst.booleans())
def test_the_twins_padded_layout_is_the_cores(counts: list[int], width: int, wide: bool) -> None:
    """BatchPlan.padded lays rows out with the core's pad_rows; the twin's pad_rows,
    written independently, gives the same arrays and the same refusal on the same input."""
    from dspark_core._ext import _row_format

    dtype = np.int64 if wide else np.int32
    seqs = np.arange(100, 100 + len(counts), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    values = np.arange(7, 7 + int(offsets[-1]), dtype=dtype)
    got = [np.full((len(counts), width), 5, dtype) for _ in range(2)]
    errors = []
    for fn, out in zip((_row_format.pad_rows, pad_rows), got):
        try:
            fn(seqs, offsets, values, width, out)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    assert errors[0] == errors[1]
    assert (errors[0] is None) == all(c <= width for c in counts)
    assert got[0].tolist() == got[1].tolist()  # also both untouched when refused


@settings(max_examples=150, deadline=None, phases=[Phase.generate])
@given(data=hst.data(), n=hst.integers(0, 6), m=hst.integers(0, 6), block_tokens=hst.integers(0, 5),
       spare=hst.integers(0, 3))
def test_the_twins_paged_layout_is_the_cores(data: Any, n: int, m: int, block_tokens: int, spare: int) -> None:
    """The core's paged layout (BatchPlan.paged) and the twin's, written independently: the same
    shifted tables, KV slots and refusal (nothing written) on the same input, the tables read at
    a row stride wider than their width (a slice of a server's persistent table)."""
    from dspark_core._ext import _row_format

    seqs = np.arange(40, 40 + n, dtype=np.int64)
    counts = data.draw(hst.lists(hst.integers(0, 4), min_size=n, max_size=n))
    pos_base = np.array(data.draw(hst.lists(hst.integers(-1, 3 * max(m, 1) * max(block_tokens, 1)),
                                            min_size=n, max_size=n)), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    reach = max(m, 1) * max(block_tokens, 1) + 2  # a few positions past the table, and negative ones
    positions = np.array(data.draw(hst.lists(hst.integers(-1, reach), min_size=int(offsets[-1]),
                                             max_size=int(offsets[-1]))), dtype=np.int32)
    wide = np.arange(1000, 1000 + n * (m + spare), dtype=np.int32).reshape(n, m + spare)
    tables = wide[:, :m]
    got = [(np.full((n, m), -5, np.int32), np.full(len(positions), -5, np.int64)) for _ in range(2)]
    errors = []
    for fn, (t_out, s_out) in zip((_row_format.paged_rows, paged_rows), got):
        try:
            fn(seqs, pos_base, offsets, positions, tables, block_tokens, 0, t_out, s_out)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    assert errors[0] == errors[1]
    assert got[0][0].tolist() == got[1][0].tolist() and got[0][1].tolist() == got[1][1].tolist()
    if errors[0] is not None:
        assert (got[0][0] == -5).all() and (got[0][1] == -5).all()  # nothing written


def test_paged_lays_a_drafted_batch_into_each_windows_blocks():
    """BatchPlan.paged on a real batch past the window: every row's slot holds its absolute
    position's KV block of the shifted table, the window's first block first."""
    kv = 4
    stg = Stager(config(rows="external"))
    seqs = np.array([0, 1, 2], dtype=np.int64)
    for s in seqs.tolist():
        stg.begin(int(s))
    lengths = [5, 30, 70]  # inside, near and past W = 48
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(k) for k in lengths]).astype(np.int64)
    stg.process_many(seqs, cu, positions)
    plan = stg.draft_many(seqs, np.array(lengths, dtype=np.int64))
    m = 20
    tables = (np.arange(3 * m, dtype=np.int32).reshape(3, m) * 7 + 3).astype(np.int32)
    paged = plan.paged(tables, kv)
    for i in range(3):
        first = int(plan.pos_base[i]) // kv
        want = [int(tables[i, j + first]) if j + first < m else 0 for j in range(m)]
        assert paged.block_tables[i].tolist() == want
        rows = slice(int(plan.row_offsets[i]), int(plan.row_offsets[i + 1]))
        for p, slot in zip(plan.positions[rows].tolist(), paged.slots[rows].tolist()):
            absolute = int(plan.pos_base[i]) + p
            # the absolute position's block of the request's own table, at its window-relative offset
            assert slot == int(tables[i, (first * kv + p) // kv]) * kv + (first * kv + p) % kv
            assert (first * kv + p) <= absolute
    assert int(plan.pos_base[2]) > 0 and paged.block_tables[2, -1] == 0  # the window moved: null past the table
    with pytest.raises(ValueError, match=r"^paged: seqs\[1\] \(sequence 1\): drafter position 12 lies outside the 3 blocks"):
        plan.paged(tables[:, :3], kv)


def test_a_batch_plan_holds_values_only():
    """A BatchPlan (core and twin) holds arrays and values and calls nothing of its maker:
    no attribute of it or of its shared context is a function or bound method."""
    import types

    for make in (Stager, ReferenceStager):
        for copy in (True, False):
            stg = make(StagerConfig(feature_dim=64, block_size=4, window=24, max_seqs=2, storage="q8_0"))
            stg.process(0, list(range(30)), massive_rows(np.random.default_rng(5), 30, 64))
            bp = stg.draft_many([0], [30], copy=copy)
            _ = (bp.rows, bp.row_runs, bp.padded(), bp.plans)  # everything derived
            held = [*vars(bp).values(), *bp._ctx]
            kinds = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)
            assert not [v for v in held if isinstance(v, kinds)], (make, copy)
            assert bp.rows.shape == (int(bp.row_offsets[-1]), 64) and bp.rows.dtype == np.float32


# -- reservations ---------------------------------------------------------------------------


def _every_other_call(stg: Any, seq: int) -> list[tuple[str, Callable[[], Any]]]:
    other = (seq + 1) % N_SEQS
    return [
        ("begin", lambda: stg.begin(seq)), ("process", lambda: stg.process(seq, [6])),
        ("check_process", lambda: stg.check_process(seq, [6])), ("draft", lambda: stg.draft(seq, 6)),
        ("commit", lambda: stg.commit(seq)), ("fail", lambda: stg.fail(seq)),
        ("accept", lambda: stg.accept(seq, 0)), ("rollback", lambda: stg.rollback(seq, 2)),
        ("shift", lambda: stg.shift(seq, 0, 1)), ("fork src", lambda: stg.fork(seq, other)),
        ("fork dst", lambda: stg.fork(other, seq)), ("snapshot", lambda: stg.snapshot(seq)),
        ("snapshot_size", lambda: stg.snapshot_size(seq)), ("reserve", lambda: stg.reserve(seq, [6])),
        ("restore", lambda: stg.restore(seq, b"")),
    ]


def test_during_a_reservation_every_call_but_confirm_cancel_and_end_is_a_state_error():
    ref = ReferenceStager(config("external"))
    started(ref, 0)
    started(ref, 1)
    slots = ref.reserve(0, [6, 7])
    assert slots.tolist() == [6, 7] and ref.state(0)["reservation_open"]
    before = digest(ref)
    message = "sequence 0 has reserved rows: call confirm() or cancel() first"
    for name, call in _every_other_call(ref, 0):
        exc = raised(call)
        assert type(exc) is StateError and str(exc) == message, name
    batches = [("process_many", 1, lambda: ref.process_many([1, 0], [0, 1, 2], [6, 6])),
               ("draft_many", 1, lambda: ref.draft_many([1, 0], [6, 8])),
               ("accept_many", 1, lambda: ref.accept_many([1, 0], [0, 0])),
               ("commit_many", 0, lambda: ref.commit_many([0])),
               ("fail_many", 0, lambda: ref.fail_many([0])),
               ("reserve_many", 1, lambda: ref.reserve_many([1, 0], [0, 1, 2], [6, 8]))]
    for name, i, call in batches:
        exc = raised(call)
        assert type(exc) is StateError and str(exc) == f"{name}: seqs[{i}] (sequence 0): {message}", name
    assert digest(ref) == before
    for one in (ref.confirm, ref.cancel):
        exc = raised(one, 1)
        assert type(exc) is StateError and str(exc) == "sequence 1 has no reserved rows (call reserve() first)"
    exc = raised(ref.confirm_many, [0, 1])
    assert str(exc) == "confirm_many: seqs[1] (sequence 1): sequence 1 has no reserved rows (call reserve() first)"
    assert str(raised(ref.cancel_many, [0, 0])) == (
        "cancel_many: sequence 0 appears twice (seqs[0] and seqs[1]): a batch names each sequence once")
    assert digest(ref) == before
    assert ref.open_round_ids([0, 0, 1]).tolist() == [0, 0, 0]  # a question: ids may repeat
    ref.confirm_many([0])
    assert not ref.state(0)["reservation_open"] and ref.state(0)["end"] == 8
    ref.process_many([1, 0], [0, 1, 2], [6, 8])


def test_reserve_needs_external_rows():
    ref = ReferenceStager(config())
    started(ref, 0)
    message = "needs external-row mode, but this Stager holds its rows (use process / process_encoded)"
    assert str(raised(ref.reserve, 0, [6])) == f"reserve {message}"
    assert str(raised(ref.reserve_many, [0], [0, 1], [6])) == f"reserve_many {message}"
    # the sequence's own errors and the positions' kind come first
    assert str(raised(ref.reserve, 0, [6.0])) == "positions must be integers, got dtype float64"
    assert str(raised(ref.reserve, 9, [6.0])) == "unknown sequence 9 (this Stager has sequences 0..4)"


def _follow_up(stg: Any, seq: int) -> list[Any]:
    """A few rounds on ``seq``: what they return, and the sequence's state after each."""
    out: list[Any] = []
    end = stg.state(seq)["end"] if stg.state(seq)["started"] else 100
    for k in range(3):
        slots = stg.process(seq, np.arange(end, end + 5))
        plan = stg.draft(seq, end + 5)
        stg.commit(seq)
        stg.accept(seq, k)
        end = stg.state(seq)["end"]
        out.append((slots.tolist(), plan.slots.tolist(), plan.positions.tolist(), plan.rebase,
                    stg.state(seq), stg.live_slots(seq).tolist()))
    return out


def test_cancel_puts_the_sequence_back_exactly_and_confirm_is_process():
    for prefill in (6, 45, 120):  # below the window, near it, far past it (rows below the horizon: slot -1)
        kept, cancelled, confirmed = (ReferenceStager(config("external")) for _ in range(3))
        for stg in (kept, cancelled, confirmed):
            started(stg, 2, prefill)
            stg.draft(2, prefill)
            stg.commit(2)
        before = digest(cancelled)
        chunk = np.arange(prefill, prefill + 60)
        slots = cancelled.reserve_many([2], [0, 60], chunk)
        assert cancelled.state(2)["end"] == prefill + 60
        cancelled.cancel_many([2])
        assert digest(cancelled) == before
        processed = kept.process(2, chunk)
        assert processed is not None
        assert confirmed.reserve(2, chunk).tolist() == slots.tolist() == processed.tolist()
        confirmed.confirm(2)
        again = cancelled.process(2, chunk)
        assert again is not None and again.tolist() == slots.tolist()
        assert digest(confirmed) == digest(kept) == digest(cancelled)
        assert _follow_up(confirmed, 2) == _follow_up(kept, 2) == _follow_up(cancelled, 2)


_END_CASES = [(rows, how) for rows in ("held", "external")
              for how in ("new", "started", "open round", "reserved", "disabled", "mismatch reported")
              if (rows, how) != ("held", "reserved")]  # reservations are external-row mode's


@pytest.mark.parametrize(("rows", "how"), _END_CASES)
def test_end_leaves_the_sequence_as_a_new_stagers(rows, how):
    stg, fresh = ReferenceStager(config(rows, strict=False)), ReferenceStager(config(rows, strict=False))
    seq = 3
    if how != "new":
        started(stg, seq, 70)
    if how == "open round":
        stg.draft(seq, 70)
    elif how == "reserved":
        stg.reserve(seq, [70, 71])
    elif how == "disabled":
        for _ in range(2):
            stg.draft(seq, 70)
            stg.fail(seq)
    elif how == "mismatch reported":
        stg.draft(seq, 50)
    stg.end(seq) if how != "new" else stg.end_many([seq])
    assert digest(stg) == digest(fresh)
    with captured_logs() as logs_a:
        stg.process(seq, [0, 1]) if rows == "external" else stg.process(seq, [0, 1], rows_at(2))
        stg.draft(seq, 1)  # out of protocol: logged again, as on a new Stager
    with captured_logs() as logs_b:
        fresh.process(seq, [0, 1]) if rows == "external" else fresh.process(seq, [0, 1], rows_at(2))
        fresh.draft(seq, 1)
    assert logs_a == logs_b and len(logs_a) == 1
    assert digest(stg) == digest(fresh)


def test_end_checks_ids_only():
    ref = ReferenceStager(config())
    assert str(raised(ref.end, 5)) == "unknown sequence 5 (this Stager has sequences 0..4)"
    assert str(raised(ref.end, "0")) == "seq must be an integer, got str"
    assert str(raised(ref.end_many, [0, 5])) == (
        "end_many: seqs[1] (sequence 5): unknown sequence 5 (this Stager has sequences 0..4)")
    assert str(raised(ref.end_many, [1, 1])) == (
        "end_many: sequence 1 appears twice (seqs[0] and seqs[1]): a batch names each sequence once")


# -- random batches: batched == per-sequence; core == reference -----------------------------


@dataclass
class Batch:
    """One batch call, and the per-sequence calls it stands for (in batch order)."""

    method: str
    args: tuple[Any, ...]
    seqs: list[Any]
    singles: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"{self.method}{self.args!r}"


_OPS = ["process", "process", "process", "draft", "draft", "draft", "accept", "accept", "commit", "commit",
        "fail", "end", "reserve", "reserve", "confirm", "cancel", "open_round_ids", "rollback", "begin"]
_FAULTS = ["none"] * 6 + ["unknown", "duplicate", "state", "value", "shape"]


def _pick(data: Any, pool: list[int], lo: int = 0) -> list[int]:
    """A random ordered subset of ``pool``."""
    chosen = data.draw(hst.lists(hst.sampled_from(pool), unique=True, min_size=min(lo, len(pool)),
                                 max_size=len(pool))) if pool else []
    return list(chosen)


def draw_batch(data: Any, stg: Any) -> Batch | None:
    """A batch for the state of ``stg``: mostly valid, sometimes with one fault."""
    cfg = stg.config
    ext = cfg.external_rows
    st = [stg.state(s) for s in range(cfg.max_seqs)]
    ready = [s for s in range(cfg.max_seqs) if not st[s]["open_round"] and not st[s]["reservation_open"]]
    opened = [s for s in range(cfg.max_seqs) if st[s]["open_round"]]
    reserved = [s for s in range(cfg.max_seqs) if st[s]["reservation_open"]]
    op = data.draw(hst.sampled_from(_OPS))
    fault = data.draw(hst.sampled_from(_FAULTS))
    if op == "rollback" and ready:  # per-sequence calls, to vary the state
        s = data.draw(hst.sampled_from(ready))
        return Batch("rollback", (s, data.draw(hst.integers(0, st[s]["end"]))), [s])
    if op == "begin" and ready:
        s = data.draw(hst.sampled_from(ready))
        return Batch("begin", (s,), [s])
    if op in ("rollback", "begin"):
        return None
    pool = {"process": ready, "reserve": ready, "draft": ready, "accept": ready, "commit": opened,
            "fail": opened, "confirm": reserved, "cancel": reserved}.get(op, list(range(cfg.max_seqs)))
    seqs: list[Any] = _pick(data, pool, 1)
    if fault == "unknown":
        seqs.insert(data.draw(hst.integers(0, len(seqs))), data.draw(hst.sampled_from([cfg.max_seqs, 99, -1])))
    elif fault == "duplicate" and seqs:
        seqs.append(data.draw(hst.sampled_from(seqs)))
    elif fault == "state":
        wrong = [s for s in range(cfg.max_seqs) if s not in pool]
        if wrong:
            seqs.insert(data.draw(hst.integers(0, len(seqs))), data.draw(hst.sampled_from(wrong)))
    n = len(seqs)

    def known(s: Any) -> bool:
        return 0 <= s < cfg.max_seqs

    def end_of(s: Any) -> int:
        return st[s]["end"] if known(s) and st[s]["started"] else 0

    if op in ("process", "reserve"):
        counts = [data.draw(hst.sampled_from([0, 1, 2, 5, 5, 30, 60])) for _ in seqs]
        starts = [end_of(s) if known(s) and st[s]["started"] else data.draw(hst.integers(0, 100)) for s in seqs]
        if fault == "value" and n:
            k = data.draw(hst.integers(0, n - 1))
            starts[k] += data.draw(hst.sampled_from([-1, 1, 3]))
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        pos = np.concatenate([np.zeros(0, np.int64), *(np.arange(p, p + c) for p, c in zip(starts, counts))])
        rows = None if ext else rows_at(len(pos), data.draw(hst.integers(0, 3)))
        if fault == "value" and rows is not None and len(pos) and data.draw(hst.booleans()):
            rows[data.draw(hst.integers(0, len(pos) - 1)), 3] = np.nan
        if fault == "shape":
            kind = data.draw(hst.sampled_from(["cu", "offsets", "rows"]))
            if kind == "cu":
                cu = cu[:-1]
            elif kind == "offsets" and n:
                cu = cu.copy()
                cu[data.draw(hst.integers(0, n))] += 1
            elif rows is not None:
                rows = rows[1:]
        # The per-sequence calls of the batch as given (none when its offsets or rows do not fit it).
        fits = len(cu) == n + 1 and cu[0] == 0 and cu[-1] == len(pos) and bool(np.all(np.diff(cu) >= 0)) \
            and (rows is None or len(rows) == len(pos))
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist())) if fits else []
        if op == "reserve":
            return Batch("reserve_many", (seqs, cu, pos), seqs, [("reserve", (s, pos[a:b])) for s, (a, b) in
                                                                 zip(seqs, spans)])
        singles = [("process", (s, pos[a:b]) if rows is None else (s, pos[a:b], rows[a:b]))
                   for s, (a, b) in zip(seqs, spans)]
        return Batch("process_many", (seqs, cu, pos) if ext else (seqs, cu, pos, rows), seqs, singles)
    if op == "draft":
        pasts = [end_of(s) + data.draw(hst.sampled_from([0, 0, 0, 0, -1, 2])) for s in seqs]
        if fault == "value" and n:
            pasts[data.draw(hst.integers(0, n - 1))] = -1
        if fault == "shape":
            pasts.append(0)
        return Batch("draft_many", (seqs, pasts), seqs, [("draft", (s, p)) for s, p in zip(seqs, pasts)])
    if op == "accept":
        acc = [data.draw(hst.integers(0, cfg.block_size)) for _ in seqs]
        if fault == "value" and n:
            acc[data.draw(hst.integers(0, n - 1))] = data.draw(hst.sampled_from([-1, cfg.block_size + 1]))
        if fault == "shape":
            return Batch("accept_many", (seqs, [float(a) for a in acc]), seqs)
        return Batch("accept_many", (seqs, acc), seqs, [("accept", (s, a)) for s, a in zip(seqs, acc)])
    if op == "fail":
        # names, or codes (the index in FAIL_STAGES): one kind per call
        choices = data.draw(hst.sampled_from([["decode", "crop"], [0, 1]]))
        stages: list[Any] = [data.draw(hst.sampled_from(choices)) for _ in seqs]
        if fault == "value" and n:
            stages[data.draw(hst.integers(0, n - 1))] = "later" if choices[0] == "decode" else 7
        names = ["decode", "crop"]
        return Batch("fail_many", (seqs, stages), seqs,
                     [("fail", (s, names[x] if x in (0, 1) else x)) for s, x in zip(seqs, stages)])
    single = {"commit": "commit", "end": "end", "confirm": "confirm", "cancel": "cancel",
              "open_round_ids": "open_round_id"}[op]
    method = "open_round_ids" if op == "open_round_ids" else f"{op}_many"
    return Batch(method, (seqs,), seqs, [(single, (s,)) for s in seqs])


_PREFIXED = re.compile(r"^(\w+): seqs\[(\d+)\] \(sequence (-?\d+)\): (.*)$", re.S)


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any, list[str]]:
    with captured_logs() as logs:
        try:
            return True, fn(*args), logs
        except (ValueError, TypeError, StateError) as exc:
            return False, exc, logs


def _same_arrays(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


_PLAN_FIELDS = ("seq", "start", "skip", "rebase", "clear_cache", "crop_from", "pos_base", "round")
_PLAN_ARRAYS = ("positions", "block_positions", "slots")


def assert_same_plan(a: Any, b: Any, external: bool) -> None:
    for name in _PLAN_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    for name in _PLAN_ARRAYS + (() if external else ("encoded_rows", "rows")):
        assert _same_arrays(getattr(a, name), getattr(b, name)), name


_BATCH_ARRAYS = ("seqs", "skip_code", "rebase", "clear_cache", "start", "pos_base", "crop_from", "round",
                 "row_offsets", "positions", "slots", "active", "n_rows", "block_positions", "row_seq")


def assert_same_batch_plan(a: Any, b: Any, external: bool) -> None:
    for name in _BATCH_ARRAYS + (() if external else ("encoded_rows", "rows")):
        assert _same_arrays(getattr(a, name), getattr(b, name)), name
    for width in (a.max_plan_rows, 8):
        pa, pb = _outcome(a.padded, (width,)), _outcome(b.padded, (width,))
        assert pa[0] == pb[0] and (str(pa[1]) == str(pb[1]) if not pa[0] else
                                   all(_same_arrays(x, y) for x, y in zip(pa[1], pb[1])))
    assert a.skips == b.skips and len(a.plans) == len(b.plans)
    for x, y in zip(a.plans, b.plans):
        assert_same_plan(x, y, external)


def batched_vs_single(data: Any, cfg: StagerConfig, steps: int) -> None:
    """Random batches on one reference, their per-sequence calls on another."""
    batched, single = ReferenceStager(cfg), ReferenceStager(cfg)
    ext = cfg.external_rows
    for _ in range(steps):
        call = draw_batch(data, batched)
        if call is None:
            continue
        if not call.method.endswith(("_many", "_ids")):  # rollback, begin: on both
            a = _outcome(getattr(batched, call.method), call.args)
            b = _outcome(getattr(single, call.method), call.args)
            assert a[0] and b[0], (call, a[1], b[1])
            assert digest(batched) == digest(single), call
            continue
        before = digest(batched)
        ok, got, logs = _outcome(getattr(batched, call.method), call.args)
        if not ok:
            assert digest(batched) == before, f"{call}: rejected, but the state changed"
            m = _PREFIXED.match(str(got))
            if m is not None:
                assert m.group(1) == call.method, (call, got)
                i, seq, said = int(m.group(2)), int(m.group(3)), m.group(4)
                assert int(np.asarray(call.seqs, np.int64)[i]) == seq
                if i < len(call.singles):
                    name, args = call.singles[i]
                    exc = _outcome(getattr(single, name), args)[1]
                    assert type(exc) is type(got) and str(exc) == said, (call, got, exc)
            assert digest(single) == digest(batched)
            continue
        results = []
        with captured_logs() as single_logs:
            for name, args in call.singles:
                results.append(getattr(single, name)(*args))
        assert single_logs == logs, call
        if call.method == "draft_many":
            assert got.seqs.tolist() == list(call.seqs)
            for plan, want in zip(got.plans, results):
                assert_same_plan(plan, want, ext)
            assert got.positions.tolist() == [x for p in results for x in p.positions.tolist()]
            assert got.slots.tolist() == [x for p in results for x in p.slots.tolist()]
            if not ext:
                assert got.rows.tobytes() == b"".join(p.rows.tobytes() for p in results)
        elif call.method in ("reserve_many", "open_round_ids") or (call.method == "process_many" and ext):
            flat = [x for r in results for x in np.atleast_1d(r).tolist()]
            assert got.dtype == np.int64 and got.tolist() == flat, call
        elif call.method == "fail_many":  # fail's answer per sequence: which got disabled
            assert got.dtype == np.int64 and got.tolist() == [int(r) for r in results], call
        else:
            assert got is None
        assert digest(batched) == digest(single), call


_CONFIGS = [dict(rows="held"), dict(rows="external"), dict(rows="held", storage="q8_0", strict=True),
            dict(rows="external", strict=True), dict(rows="held", storage="f16", nonfinite="clamp")]
#: Each example runs 20 random batches on two Stagers (about 0.1 s). No shrinking: every
#: assertion names the call it failed on, and shrinking runs of this size takes minutes.
_EXAMPLES = settings(max_examples=20, phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.mark.parametrize("kw", _CONFIGS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
@_EXAMPLES
@given(data=hst.data())
def test_batched_calls_equal_their_per_sequence_calls(kw, data):
    batched_vs_single(data, config(**kw), steps=20)


def core_vs_reference(data: Any, cfg: StagerConfig, steps: int) -> None:
    """The same random batches on the core and the reference: the same outcomes, word for word."""
    core, ref = Stager(cfg), ReferenceStager(cfg)
    for _ in range(steps):
        call = draw_batch(data, ref)
        if call is None:
            continue
        a = _outcome(getattr(core, call.method), call.args)
        b = _outcome(getattr(ref, call.method), call.args)
        assert a[0] == b[0], (call, a[1], b[1])
        assert a[2] == b[2], (call, a[2], b[2])  # the same warnings
        if not a[0]:
            assert type(a[1]) is type(b[1]) and str(a[1]) == str(b[1]), (call, a[1], b[1])
        elif call.method == "draft_many":
            assert_same_batch_plan(a[1], b[1], cfg.external_rows)
        elif isinstance(b[1], np.ndarray):
            assert _same_arrays(a[1], b[1]), call
        else:
            assert a[1] is None and b[1] is None, call
        assert digest(core) == digest(ref), call


@pytest.mark.skipif(not CORE_HAS_BATCHES, reason="this build's Stager has no batched calls")
@pytest.mark.parametrize("kw", _CONFIGS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
@_EXAMPLES
@given(data=hst.data())
def test_core_batched_calls_equal_the_reference(kw, data):
    core_vs_reference(data, config(**kw), steps=20)


def _bad_batches(stg: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """Rejected batch calls, one per check (on sequences 0 and 1 started, 1 with an open round)."""
    ext = stg.config.external_rows
    rows: tuple[Any, ...] = () if ext else (rows_at(3),)
    return [
        ("process_many", ([0, 9], [0, 1, 3], [6, 7, 8], *rows)),
        ("process_many", ([0, 1], [0, 1, 3], [6, 6, 7], *rows)),
        ("process_many", ([0, 0], [0, 1, 3], [6, 7, 8], *rows)),
        ("process_many", ([0, 2], [0, 2, 2], [6, 7, 8], *rows)),
        ("process_many", ([0, 2], [0, 1, 3], [6, 0, 2], *rows)),
        ("process_many", ([0, 2], [0, 1, 3], [7, 0, 1], *rows)),
        ("process_many", ([0, 2], [0, 1], [6, 7, 8], *rows)),
        ("reserve_many", ([0, 2], [0, 1, 3], [7, 0, 1])),
        ("reserve_many", ([2, 0, 2], [0, 1, 2, 3], [0, 6, 1])),
        ("reserve", (0, [7])),
        ("accept_many", ([0, 2], [0, 5])),
        ("draft_many", ([0, 2], [6])),
        ("draft_many", ([2, 0], [0, -3])),
        ("commit_many", ([1, 0],)),
        ("fail_many", ([1], ["later"])),
        ("confirm_many", ([0],)),
        ("cancel_many", ([3, 0],)),
        ("end_many", ([4, 4],)),
        ("open_round_ids", ([0, 5],)),
    ]


@pytest.mark.skipif(not CORE_HAS_BATCHES, reason="this build's Stager has no batched calls")
@pytest.mark.parametrize("rows", ["held", "external"])
def test_core_and_reference_reject_each_bad_batch_in_the_same_words(rows):
    core, ref = Stager(config(rows)), ReferenceStager(config(rows))
    for stg in (core, ref):
        started(stg, 0)
        started(stg, 1)
        stg.draft(1, 6)
    for k, (method, args) in enumerate(_bad_batches(ref)):
        a, b = raised(getattr(core, method), *args), raised(getattr(ref, method), *args)
        assert (type(a), str(a)) == (type(b), str(b)), (k, method)
    assert digest(core) == digest(ref)
