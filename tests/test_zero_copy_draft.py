"""``draft(seq, n_past, copy=False)``: the staged rows as views of the ring.

The oracle is the pure-Python reference twin (its plans are copies, cut
where the ring wraps) and the core's own copying draft: over rounds that
rebase and wrap the ring, for every storage format, a zero-copy plan has the
same fields, slots and bytes, its runs split where its slots do, and its
views are read-only. The views hold their rows through the calls that leave
a sequence's rows alone (commit, fail, other sequences' rounds), outlive the
rows' ring (end, the Stager's deletion: never freed memory), and a bad
``copy`` or an external-row Stager gets the reference's error word for word.
``draft_many(seqs, n_pasts, copy=False)`` is held to the same, batch against
per-sequence views, a copying batch and the reference's batch.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import Stager, StagerConfig
from dspark_core.stager.config import STORAGES, storage_row_bytes
from dspark_core.reference import ReferenceStager
from dspark_core.stager.stage_plan import BATCH_ARRAYS
from dspark_core.testing import InvariantChecker, check_plan

D, B, W = 64, 4, 24
ACCEPTS = (0, 3, 1, 4, 2)


def same_plan(a, b) -> None:
    """Two plans of the same round: fields, arrays, rows and their runs."""
    for name in ("seq", "start", "skip", "rebase", "clear_cache", "crop_from", "pos_base", "round"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("positions", "block_positions", "slots", "encoded_rows", "rows"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    for name in ("encoded_runs", "row_runs"):
        x, y = getattr(a, name), getattr(b, name)
        assert [r.shape for r in x] == [r.shape for r in y], name
        assert [r.tobytes() for r in x] == [r.tobytes() for r in y], name


def rounds(stagers, rng, n_rounds, seq=0, views=None):
    """Drive every stager through the same rounds; yield each round's plans (``views[i]``: stager i
    drafts with copy=False)."""
    prompt = massive_rows(rng, 9, D)
    for st in stagers:
        st.process(seq, np.arange(9), prompt)
    n_past = 9
    for r in range(n_rounds):
        plans = [st.draft(seq, n_past, copy=not (views and views[i])) for i, st in enumerate(stagers)]
        yield plans
        verify = massive_rows(rng, B + 1, D)
        for st in stagers:
            st.commit(seq) if r % 6 != 5 else st.fail(seq, "decode")
            st.process(seq, np.arange(n_past, n_past + B + 1), verify)
            st.accept(seq, ACCEPTS[r % len(ACCEPTS)])
        n_past += ACCEPTS[r % len(ACCEPTS)] + 1


@pytest.mark.parametrize("storage", STORAGES)
def test_views_are_the_rows_a_copy_and_the_reference_stage(storage):
    # f16 and q4_0 cannot hold the massive channels: clamped, as their error message advises.
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, storage=storage,
                       nonfinite="clamp" if storage in ("f16", "q4_0") else "error")
    core_view, core_copy, ref_view = Stager(cfg), Stager(cfg), ReferenceStager(cfg)
    wraps = rebases = 0
    for view, copy, ref in rounds([core_view, core_copy, ref_view], np.random.default_rng(1), 600,
                                  views=[True, False, True]):
        assert view.zero_copy and ref.zero_copy and not copy.zero_copy
        same_plan(view, ref)
        same_plan(view, copy)
        check_plan(view, cfg)
        assert all(not r.flags.writeable for r in view.encoded_runs + view.row_runs)
        with pytest.raises(ValueError, match="WRITEABLE"):  # and numpy will not make them writable
            view.encoded_runs[0].flags.writeable = True
        # The views are the ring's bytes, not a copy: no run owns its memory.
        assert all(r.base is not None and not r.flags.owndata for r in view.encoded_runs)
        wraps += len(view.encoded_runs) == 2
        rebases += view.rebase
    assert wraps >= 2 and rebases >= 10  # the ring wrapped under a plan, and rebases were staged


def test_f32_views_hand_out_the_ring_itself():
    """f32 rows staged as f32: rows, row_runs and encoded_runs are one memory, the ring's."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W)
    st = Stager(cfg)
    for (plan,) in rounds([st], np.random.default_rng(2), 200, views=[True]):
        runs = plan.row_runs
        for enc, rows in zip(plan.encoded_runs, runs):
            assert np.shares_memory(enc, rows)
        if len(runs) == 1:
            assert np.shares_memory(plan.rows, runs[0])
        else:  # wrapped: rows is one array, so a copy of the two runs
            assert not np.shares_memory(plan.rows, runs[0]) and not np.shares_memory(plan.rows, runs[1])
            assert not plan.rows.flags.writeable


def test_views_hold_while_the_sequence_only_commits_fails_or_others_run():
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2, storage="q8_0")
    st = Stager(cfg)
    rng = np.random.default_rng(3)
    st.process(0, np.arange(20), massive_rows(rng, 20, D))
    plan = st.draft(0, 20, copy=False)
    want = plan.encoded_rows.tobytes()
    st.fail(0, "crop")
    for _ in rounds([st], rng, 300, seq=1, views=[True]):  # sequence 1 wraps its own ring
        pass
    st.state(0), st.stats(0), st.snapshot(0)
    assert b"".join(r.tobytes() for r in plan.encoded_runs) == want
    again = st.draft(0, 20, copy=False)  # the restage after the failure: the newest w_keep of those rows
    st.commit(0)
    assert again.rebase and len(again.encoded_rows) == cfg.w_keep
    assert want.endswith(again.encoded_rows.tobytes())
    assert plan.encoded_rows.tobytes() == want


@pytest.mark.parametrize("drop", ["end", "del", "restore", "begin"])
def test_views_outlive_their_ring(drop):
    """Whatever lets the ring's bytes go or takes its slots, a view keeps reading live memory (the
    sanitizer job runs this suite: a read of freed memory fails it) that holds rows, never garbage:
    its own rows while nothing wrote over them, the rows that took their slots after that."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st = Stager(cfg)
    rows = massive_rows(np.random.default_rng(4), 30, D)
    other = massive_rows(np.random.default_rng(5), 30, D)
    st.process(0, np.arange(30), rows)
    st.process(1, np.arange(5), other[:5])
    snap = st.snapshot(1)
    plan = st.draft(0, 30, copy=False)
    runs = plan.row_runs
    n = sum(map(len, runs))
    st.commit(0)
    if drop == "end":  # the ring's bytes are released
        st.end(0)
    elif drop == "del":  # every ring is freed
        del st
    elif drop == "restore":  # another sequence's rows into this one
        st.restore(0, snap)
    else:  # the slot is reused: the same rows positions, other values, in the same slots
        st.begin(0)
        st.process(0, np.arange(30), other)
    del plan
    gc.collect()
    got = np.concatenate(runs)
    if drop == "begin":
        assert got.tobytes() == other[30 - n:].tobytes()
    elif drop == "restore":
        mine = rows[30 - n:]
        assert all(np.array_equal(g, m) or any(np.array_equal(g, o) for o in other[:5]) for g, m in zip(got, mine))
    else:
        assert got.tobytes() == rows[30 - n:].tobytes()


def test_skipped_and_refused_zero_copy_drafts():
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st, ref = Stager(cfg), ReferenceStager(cfg)
    skipped = st.draft(0, 0, copy=False)
    assert skipped.skip == "empty" and skipped.encoded_runs == () and skipped.row_runs == ()
    for bad in ("no", None, 0, 1, np.array([False])):
        errs = []
        for s in (st, ref):
            with pytest.raises(TypeError) as e:
                s.draft(0, 0, bad)
            errs.append(str(e.value))
        assert errs[0] == errs[1] and errs[0].startswith("copy must be True or False")
    for s in (st, ref):  # the sequence's own error first
        with pytest.raises(ValueError, match="unknown sequence|out of range|sequence 7"):
            s.draft(7, 0, "no")
    assert st.draft(0, 0, np.bool_(False)).zero_copy is False  # a skip holds no views

    ext = StagerConfig(feature_dim=D, block_size=B, window=W, rows="external")
    errs = []
    for s in (Stager(ext), ReferenceStager(ext)):
        s.process(0, np.arange(6))
        with pytest.raises(TypeError) as e:
            s.draft(0, 6, copy=False)
        errs.append(str(e.value))
        assert not s.state(0)["open_round"]
    assert errs[0] == errs[1] and "external-row mode" in errs[0]


@pytest.mark.parametrize("storage", STORAGES)
def test_a_rebase_onto_no_rows_stages_empty_views(storage):
    """A rollback past every row the ring holds leaves no context: the next round is a rebase
    that stages nothing. A zero-copy plan of it has no run to view and still the empty arrays
    a copying plan and the reference's have (a fuzz finding: encoded_rows raised)."""
    cfg = StagerConfig(D, B, W, max_seqs=1, storage=storage)
    x = np.clip(massive_rows(np.random.default_rng(4), 200, D, peak=3e4), -6e4, 6e4)  # f16 holds them
    plans = []
    for st, copy in ((Stager(cfg), False), (Stager(cfg), True), (ReferenceStager(cfg), False)):
        for a in range(0, 200, 10):
            st.process(0, np.arange(a, a + 10), x[a:a + 10])
        st.rollback(0, 150)  # the ring holds about W rows below 200: none below 150
        plans.append(st.draft(0, 150, copy=copy))
    view, copied, ref = plans
    assert view.skip is None and view.rebase and view.n_rows == 0 and view.zero_copy
    for other in (copied, ref):
        same_plan(view, other)
    assert view.encoded_rows.shape == (0, storage_row_bytes(storage, D)) and view.rows.shape == (0, D)
    assert view.encoded_runs == () and view.row_runs == ()


def test_invariant_checker_passes_copy_through():
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, storage="bf16")
    chk = InvariantChecker(Stager(cfg), cfg)
    for (plan,) in rounds([chk], np.random.default_rng(5), 120, views=[True]):
        assert plan.zero_copy


def test_threads_draft_views_of_their_own_sequences():
    """Two threads drafting zero-copy on their own sequences stage what a single-threaded copy does."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st = Stager(cfg)
    got: dict[int, list[bytes]] = {}

    def work(seq):
        got[seq] = [p.encoded_rows.tobytes() for (p,) in rounds([st], np.random.default_rng(10 + seq), 150, seq=seq,
                                                                    views=[True])]

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seq in (0, 1):
        solo = Stager(StagerConfig(feature_dim=D, block_size=B, window=W))
        want = [p.encoded_rows.tobytes() for (p,) in rounds([solo], np.random.default_rng(10 + seq), 150)]
        assert got[seq] == want


def same_batch(a, b) -> None:
    """Two batch plans of the same rounds: arrays, rows and their runs."""
    for name in (*BATCH_ARRAYS, "encoded_rows", "rows", "run_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
    for name in ("encoded_runs", "row_runs"):
        x, y = getattr(a, name), getattr(b, name)
        assert [(r.dtype, r.shape, r.tobytes()) for r in x] == [(r.dtype, r.shape, r.tobytes()) for r in y], name


@pytest.mark.parametrize("storage", STORAGES)
def test_batch_views_are_what_per_sequence_views_a_copy_and_the_reference_stage(storage):
    """draft_many(copy=False) over sequences that rebase and wrap their rings, listed out of
    order: the batch a copying draft_many and the reference's make, each sequence's runs those
    of its own draft(copy=False), read-only views of the rings, holding through commit / fail."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, storage=storage, max_seqs=3,
                       nonfinite="clamp" if storage in ("f16", "q4_0") else "error")
    view, copied, single, ref = Stager(cfg), Stager(cfg), Stager(cfg), ReferenceStager(cfg)
    everyone = (view, copied, single, ref)
    rng = np.random.default_rng(7)
    seqs = [2, 0, 1]
    n_past = {}
    for s in seqs:
        prompt = massive_rows(rng, 9 + 3 * s, D)
        for st in everyone:
            st.process(s, np.arange(len(prompt)), prompt)
        n_past[s] = len(prompt)
    wraps = rebases = 0
    for r in range(300):
        pasts = [n_past[s] for s in seqs]
        got = view.draft_many(seqs, pasts, copy=False)
        twin = ref.draft_many(seqs, pasts, copy=False)
        copy_batch = copied.draft_many(seqs, pasts)
        each = [single.draft(s, p, copy=False) for s, p in zip(seqs, pasts)]
        assert got.zero_copy and twin.zero_copy and not copy_batch.zero_copy
        same_batch(got, twin)
        same_batch(got, copy_batch)
        assert got.run_offsets.tolist() == np.cumsum([0] + [len(p.encoded_runs) for p in each]).tolist()
        assert [x.tobytes() for x in got.encoded_runs] == [x.tobytes() for p in each for x in p.encoded_runs]
        for a, b in zip(got.plans, each):
            assert a.zero_copy and b.zero_copy
            same_plan(a, b)
        assert all(not x.flags.writeable and not x.flags.owndata for x in got.encoded_runs)
        wraps += sum(len(p.encoded_runs) == 2 for p in each)
        rebases += int(got.rebase.sum())
        want = [x.tobytes() for x in got.encoded_runs]
        failed = [seqs[r % 3]] if r % 4 == 3 else []
        for st in everyone:
            st.commit_many([s for s in seqs if s not in failed])
            st.fail_many(failed, "crop")
        assert [x.tobytes() for x in got.encoded_runs] == want  # commit and fail leave the rows alone
        for s in seqs:
            verify = massive_rows(rng, B + 1, D)
            a = ACCEPTS[(r + s) % len(ACCEPTS)]
            for st in everyone:
                st.process(s, np.arange(n_past[s], n_past[s] + B + 1), verify)
                st.accept(s, a)
            n_past[s] += a + 1
    assert wraps >= 3 and rebases > 20, (wraps, rebases)
    assert all(view.snapshot(s) == copied.snapshot(s) == single.snapshot(s) for s in seqs)


def test_batch_views_outlive_their_rings():
    """A zero-copy batch's views keep the rings' memory: after end and the Stager's deletion they
    still read the rows they showed (the sanitizer job runs this suite)."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st = Stager(cfg)
    rows = massive_rows(np.random.default_rng(8), 30, D)
    for s in (0, 1):
        st.process(s, np.arange(30), rows)
    batch = st.draft_many([0, 1], [30, 30], copy=False)
    runs = batch.row_runs
    want = [x.tobytes() for x in runs]
    st.commit_many([0, 1])
    st.end(0)
    del st, batch
    gc.collect()
    assert [x.tobytes() for x in runs] == want


def test_refused_zero_copy_batches():
    """A bad copy, an external-row Stager: the reference's error word for word, after the batch's
    own id and state errors, and nothing opened."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2)
    ext = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2, rows="external")
    # A bad copy is named after an unknown id, before a repeated one (a conversion's place).
    cases = [(cfg, [0, 1], "no"), (cfg, [0, 7], "no"), (cfg, [0, 0], False), (ext, [0, 1], False),
             (ext, [7, 1], False), (cfg, [0, 1], np.array([False])), (cfg, [0, 0], "no"), (ext, [1, 1], False)]
    for config, seqs, copy in cases:
        errs = []
        for st in (Stager(config), ReferenceStager(config)):
            for s in (0, 1):
                st.process(s, np.arange(6), *(() if config.rows == "external" else (massive_rows(
                    np.random.default_rng(s), 6, D),)))
            with pytest.raises((TypeError, ValueError)) as e:
                st.draft_many(seqs, [6] * len(seqs), copy=copy)
            errs.append((type(e.value), str(e.value)))
            assert not st.state(0)["open_round"] and not st.state(1)["open_round"]
        assert errs[0] == errs[1], (seqs, copy)
        if seqs == [0, 0] or seqs == [1, 1]:
            assert errs[0][0] is (ValueError if copy is False and config is cfg else TypeError), errs[0]
    assert "draft_many(copy=False)" in errs[0][1] or "copy must be" in errs[0][1]
    st = Stager(cfg)  # a batch of skips holds no rows to view
    batch = st.draft_many([0, 1], [0, 0], copy=False)
    assert batch.zero_copy and batch.encoded_runs == () and batch.run_offsets.tolist() == [0, 0, 0]
    assert batch.encoded_rows.shape == (0, storage_row_bytes("f32", D)) and batch.rows.shape == (0, D)
