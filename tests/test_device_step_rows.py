"""The CSR rows of a device step's batch (``Stager.step_rows``: the unpadded layout's gather in
one call). Differential: over random workloads (rebases, skips, padding entries inside and
past the batch, entries not in the step, repeats, a batch whose size changes under one fixed
capacity) the CSR rows equal the padded layout's rows of the same step
(``row_slots[i, :n_rows[i]]`` concatenated) and the reference twin's; an unpadded step's CSR
rows equal a padded one's. Then robustness (a stale or mismatched ``out``, a damaged state:
0 rows, never a write out of bounds) and the argument errors (ValueError, nothing written)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager
from dspark_core.stager.device_step import (
    PADDING_ID, STEP_DAMAGED, STEP_OK, STEP_REBASE, STEP_STATE_FIELDS, StepOutputs, StepRows,
)


def config(n: int, b: int, w: int, storage: str = "f32") -> StagerConfig:
    return StagerConfig(feature_dim=16, block_size=b, window=w, max_seqs=n, storage=storage, rows="external")


def make(cls, n: int, b: int, w: int, seed: int):
    st = cls(config(n, b, w))
    rng = np.random.default_rng(seed)
    for q in range(n):
        st.begin(q)
        p0, ln = int(rng.integers(0, 40)), int(rng.integers(1, 3 * w))
        st.process(q, np.arange(p0, p0 + ln))
    return st


def padded_rows(out: StepOutputs, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The padded layout's rows of entries 0..n-1 as CSR: offsets, slots, positions."""
    counts = [int(out.n_rows[k]) if out.status[k] == STEP_OK else 0 for k in range(n)]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    slots = np.concatenate([out.row_slots[k, :m] for k, m in enumerate(counts)] + [np.zeros(0, np.int64)])
    positions = np.concatenate([out.row_positions[k, :m] for k, m in enumerate(counts)] + [np.zeros(0, np.int32)])
    return offsets, slots, positions


def same_csr(rows: StepRows, offsets: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
    n = len(offsets) - 1
    np.testing.assert_array_equal(rows.row_offsets[:n + 1], offsets)
    assert (rows.row_offsets[n:] == offsets[-1]).all()  # the entries past the batch: padding, no rows
    total = int(offsets[-1])
    np.testing.assert_array_equal(rows.row_slots[:total], slots)
    np.testing.assert_array_equal(rows.row_positions[:total], positions)


def host_round(sts, q: int, a: int) -> None:
    """Sequence q back on the host for one round (confirm, accept, draft, commit) and handed over
    again: its next device step drafts at its cache's end, a no_context skip."""
    for st in sts:
        st.to_host([q])
        if st.state(q)["reservation_open"]:
            st.confirm(q)
        st.accept(q, a)
        plan = st.draft(q, st.state(q)["end"])
        if plan.skip is None:
            st.commit(q)
        st.to_device([q])


@pytest.mark.parametrize("n,b,w,cap,seed,steps,wraps", [
    (1, 1, 3, 2, 1, 200, False),
    (6, 3, 11, 9, 2, 150, False),
    (16, 2, 9, 20, 3, 100, False),
    (12, 4, 16, 12, 4, 100, False),
    (4, 8, 24, 5, 5, 500, True),  # past a ring's slots: rows that wrap around it
])
def test_csr_rows_equal_the_padded_rows_and_the_reference(n, b, w, cap, seed, steps, wraps):
    rng = np.random.default_rng(seed)
    padded, unpadded, ref = make(Stager, n, b, w, seed), make(Stager, n, b, w, seed), make(ReferenceStager, n, b, w,
                                                                                             seed)
    max_rows = padded.step_layout[1]
    for st in (padded, unpadded, ref):
        st.to_device(list(range(n)))
    out_p = StepOutputs.empty(cap, max_rows, b)
    out_u = StepOutputs.empty(cap, max_rows, b, padded=False)
    out_r = StepOutputs.empty(cap, max_rows, b)
    rows_p, rows_u, rows_r = StepRows.empty(cap, max_rows), StepRows.empty(cap, max_rows), StepRows.empty(cap, max_rows)
    seen = {"rebase": 0, "skip": 0, "rows": 0, "wrap": 0}
    for _ in range(steps):
        if rng.random() < 0.1:
            host_round((padded, unpadded, ref), int(rng.integers(0, n)), int(rng.integers(0, b + 1)))
        k = int(rng.integers(0, min(n, cap) + 1))
        seqs = [int(q) for q in rng.permutation(n)[:k]]
        counts = [int(rng.integers(-1, b + 1)) if rng.random() < 0.15 else int(rng.integers(0, b + 1)) for _ in seqs]
        if seqs and rng.random() < 0.3:  # padding entries inside the batch
            at = int(rng.integers(0, len(seqs) + 1))
            seqs[at:at] = [PADDING_ID]
            counts[at:at] = [-1]
        if seqs and rng.random() < 0.1:  # a repeat: DUPLICATE, no rows
            seqs.append(seqs[0])
            counts.append(0)
        seqs, counts = seqs[:cap], counts[:cap]
        padded.step_many(seqs, counts, out=out_p)
        unpadded.step_many(seqs, counts, out=out_u)
        ref.step_many(seqs, counts, out=out_r)
        assert padded.step_rows(seqs, out_p, rows_p) is rows_p
        unpadded.step_rows(seqs, out_u, rows_u)
        ref.step_rows(seqs, out_r, rows_r)
        want = padded_rows(out_p, len(seqs))
        same_csr(rows_p, *want)
        same_csr(rows_u, *want)
        same_csr(rows_r, *want)
        ok = out_p.status[:len(seqs)] == STEP_OK
        seen["rebase"] += int(((out_p.flags[:len(seqs)] & STEP_REBASE) != 0).sum())
        seen["skip"] += int((ok & (out_p.skip[:len(seqs)] != 0)).sum())
        seen["rows"] += rows_p.total
        ring = padded.ring_rows
        for i in range(len(seqs)):
            s, _ = rows_p.entry(i)
            if s is not None and len(s) > 1 and (np.diff(s) != 1).any():
                seen["wrap"] += 1
                assert (s // ring == seqs[i]).all()
    assert seen["rebase"] and seen["skip"] and seen["rows"] and (seen["wrap"] or not wraps), seen
    for st in (padded, unpadded, ref):
        st.to_host(list(range(n)))


def test_rows_allocated_for_the_outputs_capacity():
    st = make(Stager, 4, 2, 9, 0)
    st.to_device([0, 1, 2, 3])
    out = st.step_many([2, 0], [0, 0], out=StepOutputs.empty(6, st.step_layout[1], 2))
    rows = st.step_rows([2, 0], out)
    assert isinstance(rows, StepRows) and rows.capacity == 6
    same_csr(rows, *padded_rows(out, 2))


def test_a_stale_or_mismatched_out_writes_no_row_out_of_bounds():
    """Steps' outputs handed to step_rows with other ids, scribbled plans, a damaged state: every
    row written is one the named sequence's ring holds, within the flat arrays; the CPU twin and
    the reference agree wherever the state is the reference's too."""
    n, b, w, cap = 6, 3, 11, 6
    rng = np.random.default_rng(7)
    st, ref = make(Stager, n, b, w, 7), make(ReferenceStager, n, b, w, 7)
    max_rows, ring = st.step_layout[1], st.ring_rows
    for x in (st, ref):
        x.to_device(list(range(n)))
    out, out_r = StepOutputs.empty(cap, max_rows, b), StepOutputs.empty(cap, max_rows, b)
    for _ in range(80):
        seqs = [int(q) for q in rng.permutation(n)]
        counts = [int(c) for c in rng.integers(0, b + 1, n)]
        st.step_many(seqs, counts, out=out)
        ref.step_many(seqs, counts, out=out_r)
        stale = StepOutputs(**{k: np.copy(v) for k, v in out.__dict__.items()})
        other = [int(q) for q in rng.permutation(n)]  # the same outputs, other ids
        if rng.random() < 0.5:  # scribbled plans
            stale.n_rows[:] = rng.integers(-5, 3 * max_rows, cap)
            stale.start[:] = rng.integers(-5, 2**62, cap) if rng.random() < 0.3 else stale.start + rng.integers(-3, 4)
            stale.pos_base[:] = stale.pos_base + rng.integers(-3, 4, cap)
        rows = StepRows(np.full(cap + 1, -7, np.int64), np.full(cap * max_rows + 8, -7, np.int64)[:cap * max_rows],
                        np.full(cap * max_rows, -7, np.int32))
        guard = rows.row_slots.base
        st.step_rows(other, stale, rows)
        rows_r = ref.step_rows(other, stale, StepRows.empty(cap, max_rows))
        np.testing.assert_array_equal(rows.row_offsets, rows_r.row_offsets)
        total = rows.total
        np.testing.assert_array_equal(rows.row_slots[:total], rows_r.row_slots[:total])
        np.testing.assert_array_equal(rows.row_positions[:total], rows_r.row_positions[:total])
        assert (np.diff(rows.row_offsets) >= 0).all() and total <= cap * max_rows
        assert (guard[cap * max_rows:] == -7).all()
        for i, q in enumerate(other):
            s, p = rows.entry(i)
            assert len(s) <= max_rows and (s // ring == q).all() and (p >= 0).all() and (p < w).all()
        assert (rows.row_slots[total:] == -7).all()
    # A damaged state: the entry has no rows (its ring is not trusted), its neighbours keep theirs.
    seqs = list(range(n))
    st.step_many(seqs, [0] * n, out=out)
    state = st.step_state
    cap_col = STEP_STATE_FIELDS.index("cap")
    keep = state[cap_col, 2]
    state[cap_col, 2] = 3  # a ring capacity no ring has
    rows = st.step_rows(seqs, out)
    assert rows.entry(2)[0].size == 0
    want = padded_rows(out, n)
    for i in (0, 1, 3):
        np.testing.assert_array_equal(rows.entry(i)[0], want[1][want[0][i]:want[0][i + 1]])
    assert st.step_many([2], [0]).status[0] == STEP_DAMAGED
    state[cap_col, 2] = keep


def test_argument_errors_write_nothing():
    b = 2
    st = make(Stager, 4, b, 9, 1)
    max_rows = st.step_layout[1]
    st.to_device([0, 1, 2, 3])
    seqs = [0, 1, 2]
    out = st.step_many(seqs, [0, 0, 0], out=StepOutputs.empty(4, max_rows, b))

    def fresh(cap: int = 4) -> StepRows:
        return StepRows(np.full(cap + 1, -9, np.int64), np.full(cap * max_rows, -9, np.int64),
                        np.full(cap * max_rows, -9, np.int32))

    bad = [
        fresh(2),  # capacity below the batch
        StepRows(np.full(5, -9, np.int32), fresh().row_slots, fresh().row_positions),  # dtype
        StepRows(fresh().row_offsets, np.full(4 * max_rows - 1, -9, np.int64), fresh().row_positions),  # shape
        StepRows(fresh().row_offsets, fresh().row_slots, np.full(4 * max_rows, -9, np.int64)),  # dtype
        StepRows(fresh().row_offsets, np.full((4, max_rows), -9, np.int64), fresh().row_positions),  # 2-d
        StepRows(fresh().row_offsets, np.full(8 * max_rows, -9, np.int64)[::2], fresh().row_positions),  # strided
        StepRows(np.zeros(0, np.int64), None, None),  # no offsets
    ]
    for rows in bad:
        before = [None if a is None else a.copy() for a in (rows.row_offsets, rows.row_slots, rows.row_positions)]
        with pytest.raises(ValueError, match="step rows"):
            st.step_rows(seqs, out, rows)
        for a, was in zip((rows.row_offsets, rows.row_slots, rows.row_positions), before):
            if a is not None:
                np.testing.assert_array_equal(a, was)
    ro = fresh()
    ro.row_slots.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        st.step_rows(seqs, out, ro)
    assert (ro.row_offsets == -9).all()
    with pytest.raises(ValueError, match="step outputs"):  # outputs of a capacity below the batch
        st.step_rows(seqs, StepOutputs.empty(2, max_rows, b), fresh())
    odd = StepOutputs(**{k: np.copy(v) for k, v in out.__dict__.items()})
    odd.n_rows = odd.n_rows.astype(np.int32)  # a plan array of another dtype
    with pytest.raises(ValueError, match="step outputs: n_rows must be int64"):
        st.step_rows(seqs, odd, fresh())
    odd.n_rows = np.zeros(3, np.int64)  # of another capacity than status
    with pytest.raises(ValueError, match="step outputs: n_rows must be int64 of shape"):
        st.step_rows(seqs, odd, fresh())
    odd.n_rows = None
    with pytest.raises(TypeError, match="n_rows must be a numpy array"):
        st.step_rows(seqs, odd, fresh())
    with pytest.raises(TypeError, match="StepOutputs"):
        st.step_rows(seqs, "out", fresh())
    with pytest.raises(TypeError, match="StepRows"):
        st.step_rows(seqs, out, "rows")
    with pytest.raises(ValueError):
        StepRows.empty(-1, max_rows)
    # Only the slots, or only the offsets.
    rows = StepRows(np.zeros(5, np.int64), None, None)
    st.step_rows(seqs, out, rows)
    np.testing.assert_array_equal(rows.row_offsets, np.concatenate([padded_rows(out, 3)[0], [rows.total]]))
    held = Stager(StagerConfig(feature_dim=16, block_size=b, window=9, max_seqs=2))
    with pytest.raises(ValueError, match="external"):
        held.step_rows([], StepOutputs.empty(0, max_rows, b), StepRows.empty(0, max_rows))
