"""The device step through Python: ``Stager.step_many`` (the core's CPU twin) against
two oracles, a core Stager driven by per-sequence calls and the reference twin
(``ReferenceStager.step_many``, built from the reference's own per-sequence
operations). Random steps over every storage, with sequences handed over and back
at random, drafter failures reported at hand-back, cancels and bad entries; then
the refusals and the atomicity of rejected calls."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.stager.device_step import (
    NOT_STEPPED, STEP_BAD_COUNT, STEP_CLEAR_CACHE, STEP_DUPLICATE, STEP_NOT_IN_STEP, STEP_NOT_ON_DEVICE, STEP_OK,
    STEP_REBASE, StepOutputs,
)
from dspark_core.errors import StateError
from dspark_core.reference import ReferenceStager

SKIP_CODES = {None: 0, "disabled": 1, "empty": 2, "no_context": 3, "missing_rows": 4, "drafting_off": 5}


def config(n: int, b: int, w: int, storage: str = "f32", rows: str = "external", kind: str = "block") -> StagerConfig:
    return StagerConfig(feature_dim=32, block_size=b, window=w, max_seqs=n, storage=storage, rows=rows, kind=kind)


def host_step(st, q: int, a: int, stage: str | None, ids=None) -> tuple[object, np.ndarray]:
    """One step of ``q`` in per-sequence calls: confirm, accept, draft, commit or fail, reserve
    (``ids``: a chain drafter's, the id of the row at each position)."""
    b = st.config.block_size
    if st.state(q)["reservation_open"]:
        st.confirm(q)
    st.accept(q, a)
    plan = st.draft(q, st.state(q)["end"])
    if plan.skip is None:
        if stage is None:
            st.commit(q)
        else:
            st.fail(q, stage)
    end = st.state(q)["end"]
    n_verify = b + 1 if plan.skip is None else 1
    verify = np.full(b + 1, -1, np.int64)
    pos = np.arange(end, end + n_verify)
    verify[:n_verify] = st.reserve(q, pos, tokens=None if ids is None else ids(pos))
    return plan, verify


def expect_entry(out: StepOutputs, k: int, plan, verify: np.ndarray) -> None:
    """Entry k of a step equals the per-sequence calls' plan and verify slots."""
    assert out.status[k] == STEP_OK
    assert out.skip[k] == SKIP_CODES[plan.skip]
    assert out.flags[k] == (STEP_REBASE if plan.rebase else 0) | (STEP_CLEAR_CACHE if plan.clear_cache else 0)
    assert out.start[k] == plan.start
    n = len(plan.slots) if plan.skip is None else 0
    assert out.n_rows[k] == n
    if plan.skip is None:
        assert out.pos_base[k] == plan.pos_base and out.crop_from[k] == plan.crop_from
        np.testing.assert_array_equal(out.row_slots[k, :n], plan.slots)
        np.testing.assert_array_equal(out.row_positions[k, :n], plan.positions)
        np.testing.assert_array_equal(out.block_positions[k], plan.block_positions)
    else:
        assert out.pos_base[k] == -1 and out.crop_from[k] == -1
        assert (out.block_positions[k] == -1).all()
    assert (out.row_slots[k, n:] == -1).all() and (out.row_positions[k, n:] == -1).all()
    np.testing.assert_array_equal(out.verify_slots[k], verify)


def same_outputs(x: StepOutputs, y: StepOutputs) -> None:
    for name in StepOutputs.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)


def same_seq(a, b, q: int) -> None:
    assert a.state(q) == b.state(q)
    sa, sb = a.stats(q), b.stats(q)
    common = sa.keys() & sb.keys()  # the reference keeps the semantic counters only
    assert {k: sa[k] for k in common} == {k: sb[k] for k in common}
    np.testing.assert_array_equal(a.accepted(q), b.accepted(q))
    np.testing.assert_array_equal(a.live_slots(q), b.live_slots(q))
    s = a.state(q)
    if not s["reservation_open"] and not s["open_round"]:
        assert a.snapshot(q) == b.snapshot(q)
    if a.config.kind == "chain":
        np.testing.assert_array_equal(a.tokens(q, s["horizon"], s["end"]), b.tokens(q, s["horizon"], s["end"]))


def prompt(st, q: int, p0: int, n: int, ids=None) -> None:
    st.begin(q)
    pos = np.arange(p0, p0 + n)
    st.process(q, pos, tokens=None if ids is None else ids(pos))


class _Ids:
    """A chain drafter's row ids for the differential: a function of the sequence, the
    position and a generation bumped by each of its steps (a verify row at a position an
    accept freed gets a new id, so an id left behind at a slot shows), and the slot token
    tables the core and the twin hand them over in. ``None`` tables: a block drafter."""

    def __init__(self, n: int, dev, ref) -> None:
        self.chain = dev.config.kind == "chain"
        self.gen = [0] * n
        self.dev = dev.new_token_table() if self.chain else None
        self.ref = ref.new_token_table() if self.chain else None

    def of(self, q: int):
        if not self.chain:
            return None
        g = self.gen[q]
        return lambda pos: ((g * 1000003 + np.asarray(pos, np.int64) * 31 + q) % 2_000_000_000).astype(np.int32)

    def write_verify(self, out: StepOutputs, k: int, q: int) -> None:
        """The server's verify batch: its ids at the step's verify slots, in both tables."""
        if self.chain:
            slots = out.verify_slots[k]
            ids = self.of(q)(out.start[k] + np.arange(len(slots)))
            for t in (self.dev, self.ref):
                t[slots[slots >= 0]] = ids[slots >= 0]


#: Host batch calls (beside their per-sequence arguments) that refuse a handed-over sequence.
#: (enable_many / disable_many take a handed-over sequence: the steps above switch it on all three.)
MIXED_CALLS = {
    "accept_many": lambda k: ([0] * k,), "draft_many": lambda k: ([0] * k,), "commit_many": lambda k: (),
    "fail_many": lambda k: (),
    "confirm_many": lambda k: (), "cancel_many": lambda k: (), "accepted_many": lambda k: (),
    "open_round_ids": lambda k: (),
}


def mixed_batch(dev, ref, rng, n: int, on_dev: np.ndarray) -> None:
    """One host batch call naming a handed-over sequence among host ones, an unknown id and
    repeats, in a random order: the core and the twin answer it alike; a refusal (the core's
    order of checks: ids, then states in batch order) changes nothing."""
    batch = [int(rng.choice(np.flatnonzero(on_dev)))] + [int(q) for q in rng.integers(-1, n + 2, 3)]
    batch = [int(q) for q in rng.permutation(batch)]
    name = str(rng.choice(sorted(MIXED_CALLS)))
    args = MIXED_CALLS[name](len(batch))
    host = [q for q in range(n) if not on_dev[q]]
    before = [(dev.state(q), dev.stats(q)) for q in host]
    got = []
    for st in (dev, ref):
        try:
            got.append(("ok", np.asarray(getattr(st, name)(batch, *args)).tolist()))
        except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
            got.append(("raise", (type(exc), str(exc))))
    assert got[0] == got[1], (name, batch, got)
    if got[0][0] == "raise":
        assert [(dev.state(q), dev.stats(q)) for q in host] == before, (name, batch)
    else:  # a question (a handed-over sequence's metrics are live): nothing to change
        assert name in ("accepted_many", "open_round_ids"), (name, batch, got)


@pytest.mark.parametrize("n,b,w,storage,seed,steps,kind", [
    (1, 1, 3, "f32", 11, 400, "block"),
    (5, 3, 11, "f16", 12, 250, "block"),
    (16, 2, 9, "bf16", 13, 150, "block"),
    (32, 4, 16, "q8_0", 14, 80, "block"),
    (9, 2, 7, "q4_0", 15, 200, "block"),
    (1, 1, 3, "f32", 21, 300, "chain"),
    (7, 3, 11, "f16", 22, 200, "chain"),
    (16, 2, 9, "q8_0", 23, 120, "chain"),
])
def test_step_many_equals_per_sequence_calls_and_the_reference(n, b, w, storage, seed, steps, kind):
    """A chain drafter's Stager hands its ids over in the slot token table: the test writes
    each verify row's id at its verify slot (as a server does), the core's and the twin's
    tables agree after every hand-over, and every hand-back compares the ids too."""
    rng = np.random.default_rng(seed)
    cfg = config(n, b, w, storage, kind=kind)
    dev, orc, ref = Stager(cfg), Stager(cfg), ReferenceStager(cfg)
    ids = _Ids(n, dev, ref)
    for q in range(n):
        p0, ln = int(rng.integers(0, 60)), int(rng.integers(1, 3 * w))
        for st in (dev, orc, ref):
            prompt(st, q, p0, ln, ids.of(q))
    on_dev = np.zeros(n, bool)
    rebases = 0
    skips = {"drafting_off": 0, "disabled": 0}
    for _ in range(steps):
        if rng.random() < 0.15:  # the server's switch, on the host or on the device alike
            q, off = int(rng.integers(0, n)), bool(rng.random() < 0.6)
            for st in (dev, orc, ref):
                (st.disable if off else st.enable)(q)
        go = [q for q in range(n) if not on_dev[q] and rng.random() < 0.2]  # disabled ones too: they skip
        back = [q for q in range(n) if on_dev[q] and rng.random() < 0.05]
        if back:
            dev.to_host(back, tokens=ids.dev)
            ref.to_host(back, tokens=ids.ref)
            on_dev[back] = False
            for q in back:
                same_seq(dev, orc, q)
                same_seq(ref, orc, q)
                if dev.state(q)["reservation_open"] and rng.random() < 0.3:
                    for st in (dev, orc, ref):
                        st.cancel(q)
                    same_seq(dev, orc, q)
        if go:
            dev.to_device(go, tokens=ids.dev)
            ref.to_device(go, tokens=ids.ref)
            on_dev[go] = True
            if ids.chain:
                np.testing.assert_array_equal(ids.dev, ids.ref)
        if on_dev.any() and rng.random() < 0.2:  # a host batch naming a handed-over sequence among others
            mixed_batch(dev, ref, rng, n, on_dev)
        seqs = [int(q) for q in rng.permutation(np.flatnonzero(on_dev))]
        counts = [int(rng.integers(-1, b + 1)) if rng.random() < 0.15 else int(rng.integers(0, b + 1))
                  for _ in seqs]
        if seqs and rng.random() < 0.1:
            seqs.append(seqs[0])  # a repeat: DUPLICATE
            counts.append(0)
        if rng.random() < 0.05:
            seqs.append(n + 2)  # unknown: NOT_ON_DEVICE
            counts.append(0)
        x = dev.step_many(seqs, counts)
        y = ref.step_many(seqs, counts)
        same_outputs(x, y)
        # The metrics, handed-over sequences as of their handover: the core's and the twin's.
        td, tr = dev.totals(), ref.totals()
        assert {k: td.stats[k] for k in tr.stats} == tr.stats
        np.testing.assert_array_equal(td.accepted, tr.accepted)
        assert td.started == tr.started
        failed = []
        for k, (q, a) in enumerate(zip(seqs, counts)):
            if k > 0 and q in seqs[:k]:
                assert x.status[k] == STEP_DUPLICATE
            elif q >= n:
                assert x.status[k] == STEP_NOT_ON_DEVICE
            elif a == -1:
                assert x.status[k] == STEP_NOT_IN_STEP and x.skip[k] == NOT_STEPPED
            else:
                stage = ("decode", "crop")[int(rng.integers(0, 2))] if rng.random() < 0.05 else None
                ids.gen[q] += 1
                plan, verify = host_step(orc, q, a, stage, ids.of(q))
                expect_entry(x, k, plan, verify)
                rebases += plan.rebase
                if plan.skip in skips:
                    skips[plan.skip] += 1
                if stage is not None and plan.skip is None:
                    failed.append((q, stage))  # no verify batch: its ids are never written
                else:
                    ids.write_verify(x, k, q)
        if failed:  # the drafter failed on these rounds: back with their outcome
            qs, stages = [q for q, _ in failed], [s for _, s in failed]
            np.testing.assert_array_equal(dev.to_host(qs, stages, tokens=ids.dev),
                                          ref.to_host(qs, stages, tokens=ids.ref))
            on_dev[qs] = False
            for q in qs:
                if ids.chain:  # the server drops a failed round's verify rows
                    for st in (dev, orc, ref):
                        st.cancel(q)
                same_seq(dev, orc, q)
                same_seq(ref, orc, q)
        for q in range(n):  # host sequences step by per-sequence calls on all three
            if on_dev[q] or orc.state(q)["disabled"]:
                continue
            a = int(rng.integers(0, b + 1))
            ids.gen[q] += 1
            for st in (dev, orc, ref):
                host_step(st, q, a, None, ids.of(q))
    assert rebases > 0 and skips["drafting_off"] > 0, skips
    held = list(np.flatnonzero(on_dev))
    dev.to_host(held, tokens=ids.dev)
    ref.to_host(held, tokens=ids.ref)
    for q in range(n):
        same_seq(dev, orc, q)
        same_seq(ref, orc, q)
    assert orc.totals().stats["verified_rounds"] > 0
    np.testing.assert_array_equal(dev.totals().accepted, orc.totals().accepted)


#: Every host-only call on sequence 0, handed over (all but end / end_many, which end it:
#: test_device_step_safety.py, and the metrics, which read the step state: test_metrics.py) (sequence 1 holds rows and stays on the
#: host; a batch naming both, 1 first where 1 passes the call's checks, refuses as a whole).
HOST_CALLS = (
    lambda s: s.accept(0, 0), lambda s: s.draft(0, 5), lambda s: s.process(0, [5]), lambda s: s.reserve(0, [5]),
    lambda s: s.begin(0), lambda s: s.rollback(0, 1), lambda s: s.fork(0, 1),
    lambda s: s.fork(1, 0), lambda s: s.shift(0, 1, 1), lambda s: s.snapshot(0), lambda s: s.state(0),
    lambda s: s.live_slots(0), lambda s: s.accept_many([0], [0]),
    lambda s: s.commit(0), lambda s: s.fail(0, "decode"), lambda s: s.confirm(0), lambda s: s.cancel(0),
    lambda s: s.snapshot_size(0), lambda s: s.snapshot_into(0, bytearray(4096)),
    lambda s: s.restore(0, s.snapshot(1)), lambda s: s.check_restore(0, s.snapshot(1)),
    lambda s: s.open_round_id(0),
    lambda s: s.accept_many([1, 0], [0, 0]), lambda s: s.commit_many([0, 1]), lambda s: s.fail_many([0, 1]),
    lambda s: s.confirm_many([0, 1]), lambda s: s.cancel_many([0, 1]),
    lambda s: s.draft_many([1, 0], [4, 5]), lambda s: s.process_many([1, 0], [0, 1, 2], [4, 5]),
    lambda s: s.reserve_many([1, 0], [0, 1, 2], [4, 5]),
)


def _prefix_calls(store):
    """The prefix store's calls on sequence 0 through its Stager (publish / hit, single and batched)."""
    keys = [1, 2]
    return (
        lambda s: store.publish(s, 0, keys, 0, 4), lambda s: store.hit(s, 0, keys, 4),
        lambda s: store.publish_many(s, [1, 0], [keys, keys], [0, 0], [4, 4]),
        lambda s: store.hit_many(s, [0], [keys], [4]),
    )


@pytest.mark.parametrize("twin", [False, True], ids=["core", "reference"])
def test_host_calls_refuse_a_handed_over_sequence(twin):
    from dspark_core import PrefixStore
    from dspark_core.reference import ReferencePrefixStore

    cfg = config(2, 2, 9)
    s = (ReferenceStager if twin else Stager)(cfg)
    store = (ReferencePrefixStore if twin else PrefixStore)(cfg, 2, 1 << 20)
    prompt(s, 0, 0, 5)
    prompt(s, 1, 0, 4)
    s.to_device([0])
    assert s.on_device(0)
    other = (s.state(1), s.stats(1), s.snapshot(1))
    for k, call in enumerate(HOST_CALLS + _prefix_calls(store)):
        with pytest.raises(StateError, match=r"to_host\(\[0\]\)"):
            call(s)
        assert (s.state(1), s.stats(1), s.snapshot(1)) == other, k  # nothing half-applied
    s.to_host([0])
    assert not s.on_device(0)
    assert s.state(0)["end"] == 5


def test_faults_and_statuses_raise_the_cores_errors():
    for st in (Stager(config(2, 3, 12)), ReferenceStager(config(2, 3, 12))):
        for q in (0, 1):
            prompt(st, q, 0, 8)
        st.to_device([0, 1])
        out = st.step_many([0, 1], [0, 4])  # 4 > B
        assert out.status.tolist() == [STEP_OK, STEP_BAD_COUNT]
        with pytest.raises(ValueError, match=r"step_many: seqs\[1\] \(sequence 1\): n_accepted must be in \[0, 3\]"):
            st.check_step([0, 1], out.status)
        again = st.step_many([1], [1])
        assert again.status.tolist() == [STEP_BAD_COUNT]  # sticky
        with pytest.raises(ValueError, match=r"sequence 1 is back on the host.*got 4"):
            st.to_host([0, 1])
        assert not st.on_device(1)
        assert st.state(1)["end"] == 8  # the faulted step changed nothing
        st.check_step([0], [STEP_OK])


def test_rejected_calls_change_nothing():
    st = Stager(config(3, 2, 9))
    prompt(st, 0, 0, 6)
    prompt(st, 1, 0, 4)  # sequence 2 never started
    before = (st.state(0), st.stats(0), st.snapshot(0))
    with pytest.raises(StateError, match="holds no rows"):
        st.to_device([0, 2])
    with pytest.raises(ValueError, match="appears twice"):
        st.to_device([0, 1, 0])
    assert not st.on_device(0) and not st.on_device(1)
    st.to_device([0, 1])
    with pytest.raises(StateError, match="not on the device"):
        st.to_host([0, 2])
    with pytest.raises(StateError, match="no open round to fail"):
        st.to_host([0, 1], ["decode", None])
    with pytest.raises(ValueError, match="outcome must be one of"):
        st.to_host([0, 1], ["oops", None])
    assert st.on_device(0) and st.on_device(1)
    # Wrong output arrays are refused before the core writes anything.
    bad = StepOutputs.empty(2, 7, 2)
    bad.verify_slots = np.zeros((2, 2), np.int64)
    with pytest.raises(ValueError, match="verify_slots"):
        st.step_many([0, 1], [0, 0], out=bad)
    strided = StepOutputs.empty(2, 7, 2)
    strided.status = np.zeros(4, np.int32)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        st.step_many([0, 1], [0, 0], out=strided)
    with pytest.raises(TypeError):
        st.step_many([0, 1], [0, 0], out=object())
    st.to_host([0, 1])
    assert (st.state(0), st.stats(0), st.snapshot(0)) == before
    held = Stager(config(1, 2, 9, rows="held"))
    with pytest.raises(ValueError, match="external-row mode"):
        held.to_device([0])
    with pytest.raises(ValueError, match="external-row mode"):
        held.step_many([0], [0])


def test_outputs_are_reused_in_place():
    st = Stager(config(2, 2, 9))
    for q in (0, 1):
        prompt(st, q, 0, 5)
    st.to_device([0, 1])
    out = StepOutputs.empty(2, *st.step_layout[1:], 2)
    ids = [id(getattr(out, f)) for f in StepOutputs.__dataclass_fields__]
    for _ in range(5):
        assert st.step_many([0, 1], [1, 1], out=out) is out
    assert ids == [id(getattr(out, f)) for f in StepOutputs.__dataclass_fields__]
    assert (out.status == STEP_OK).all()
    st.to_host([0, 1])


def test_compact_outputs_equal_the_padded_ones():
    """``padded=False`` writes everything but the padded rows, the same values."""
    a, b, ref = Stager(config(3, 2, 9)), Stager(config(3, 2, 9)), ReferenceStager(config(3, 2, 9))
    for st in (a, b, ref):
        for q in range(3):
            prompt(st, q, 2 * q, 5 + q)
        st.to_device([2, 0, 1])
    rng = np.random.default_rng(3)
    for _ in range(30):
        counts = rng.integers(0, 3, 3).tolist()
        full = a.step_many([2, 0, 1], counts)
        compact = b.step_many([2, 0, 1], counts, out=StepOutputs.empty(3, 7, 2, padded=False))
        mirror = ref.step_many([2, 0, 1], counts, out=StepOutputs.empty(3, 7, 2, padded=False))
        assert compact.row_slots is None and compact.row_positions is None
        for name in StepOutputs.__dataclass_fields__:
            if getattr(compact, name) is not None:
                np.testing.assert_array_equal(getattr(full, name), getattr(compact, name), err_msg=name)
                np.testing.assert_array_equal(getattr(mirror, name), getattr(compact, name), err_msg=name)


@pytest.mark.parametrize("storage,n,steps", [("f32", 4, 300), ("f16", 16, 150), ("bf16", 4, 300),
                                             ("q8_0", 32, 100), ("q4_0", 16, 150)])
def test_gathered_rows_equal_a_held_stagers_plans(storage, n, steps):
    """The step's gather slots over a HostRing read exactly the rows a held Stager, driven by
    per-sequence calls (process, accept, draft, commit), stages: window crossings and rebases
    included, sequences handed over and back; once every sequence is back, its state and the
    counters both row modes keep are the held Stager's."""
    from dspark_core import HostRing
    from dspark_core.reference import SEMANTIC_STATS

    b, w, d = 3, 14, 32
    held = Stager(StagerConfig(feature_dim=d, block_size=b, window=w, max_seqs=n, storage=storage))
    ext = Stager(StagerConfig(feature_dim=d, block_size=b, window=w, max_seqs=n, storage=storage, rows="external"))
    ring = HostRing(ext)
    rng = np.random.default_rng(7)
    for q in range(n):
        x = rng.standard_normal((5 + 3 * q, d)).astype(np.float32)
        held.process(q, np.arange(len(x)), x)
        ring.write(q, np.arange(len(x)), ring.upload(x))
    on = np.zeros(n, bool)
    counts = np.zeros(n, np.int64)
    rebases = 0
    for _ in range(steps):
        go = [q for q in range(n) if not on[q] and rng.random() < 0.3]
        back = [q for q in range(n) if on[q] and rng.random() < 0.05]
        if back:
            ext.to_host(back)
            on[back] = False
            for q in back:  # on the host: its verify rows confirmed, its accept applied
                ext.confirm(q)
                ext.accept(q, int(counts[q]))
        if go:
            ext.to_device(go)
            on[go] = True
        seqs = [q for q in range(n) if on[q]]
        out = ext.step_many(seqs, [int(counts[q]) for q in seqs]) if seqs else None
        for q in range(n):
            a = int(counts[q])
            held.accept(q, a)
            plan = held.draft(q, held.state(q)["end"])
            if plan.skip is None:
                held.commit(q)
                rebases += plan.rebase
            if on[q]:
                assert out is not None
                k = seqs.index(q)
                m = int(out.n_rows[k])
                got = ring.gather_slots(out.row_slots[k, :m])
                want = plan.rows if plan.skip is None else np.zeros((0, d), np.float32)
                np.testing.assert_array_equal(got, want)
                verify = out.verify_slots[k]
            else:  # host sequences: the same per-sequence calls on the external Stager
                if ext.state(q)["reservation_open"]:
                    ext.confirm(q)
                ext.accept(q, a)
                xp = ext.draft(q, ext.state(q)["end"])
                assert xp.skip == plan.skip
                if xp.skip is None:
                    np.testing.assert_array_equal(ring.gather(xp), plan.rows)  # while the round is open
                    ext.commit(q)
                end = ext.state(q)["end"]
                nv = b + 1 if xp.skip is None else 1
                verify = np.full(b + 1, -1, np.int64)
                verify[:nv] = ext.reserve(q, np.arange(end, end + nv))
            nv = b + 1 if plan.skip is None else 1
            rows = rng.standard_normal((nv, d)).astype(np.float32)  # the verify forward's rows
            end = held.state(q)["end"]
            held.process(q, np.arange(end, end + nv), rows)
            ring.write_slots(verify[:nv], ring.upload(rows))
            counts[q] = int(rng.integers(0, b + 1)) if nv > 1 else 0
    assert rebases > 0
    ext.to_host([q for q in range(n) if on[q]])
    for q in range(n):
        if ext.state(q)["reservation_open"]:
            ext.confirm(q)  # its verify rows were written, as held.process wrote them
        assert ext.state(q) == held.state(q), q
        assert {k: ext.stats(q)[k] for k in SEMANTIC_STATS} == {k: held.stats(q)[k] for k in SEMANTIC_STATS}, q
        assert np.array_equal(ext.accepted(q), held.accepted(q)), q
    assert held.totals().stats["verified_rounds"] > 0
    assert np.array_equal(ext.totals().accepted, held.totals().accepted)


def _chain_table_script(cls) -> tuple[list[str], list[np.ndarray]]:
    """The slot token table's refusals and hand-overs on a chain drafter's Stager (``cls``:
    the core or the twin): the messages, in order, and the tables and ids it saw."""
    ids = lambda pos: (40 + np.asarray(pos)).astype(np.int32)  # noqa: E731 - the row at p has id 40 + p
    st, block = cls(config(3, 2, 9, kind="chain")), cls(config(3, 2, 9))
    prompt(st, 0, 0, 6, ids)
    prompt(st, 1, 0, 3, ids)
    prompt(block, 0, 0, 6)
    msgs: list[str] = []
    seen: list[np.ndarray] = []

    def refused(exc, call, *args, **kw):
        with pytest.raises(exc) as info:
            call(*args, **kw)
        msgs.append(str(info.value))

    table = st.new_token_table()
    assert table.dtype == np.int32 and table.shape == (3 * st.ring_rows,) and (table == -1).all()
    table[:] = 77
    whole = {q: (st.state(q), st.stats(q), st.snapshot(q)) for q in (0, 1)}
    refused(ValueError, st.to_device, [0])
    refused(TypeError, st.to_device, [0], tokens=table.tolist())
    refused(TypeError, st.to_device, [0], tokens=table.astype(np.int64))
    refused(ValueError, st.to_device, [0], tokens=table.reshape(3, -1))
    refused(ValueError, st.to_device, [0], tokens=table[::2])
    ro = table.copy()
    ro.flags.writeable = False
    refused(ValueError, st.to_device, [0], tokens=ro)
    refused(ValueError, st.to_device, [0], tokens=table[:-1].copy())
    refused(ValueError, block.to_device, [0], tokens=table)
    refused(ValueError, st.to_device, [1, 0, 1], tokens=table)  # after a valid part
    assert not st.on_device(0) and not st.on_device(1) and not block.on_device(0)
    assert (table == 77).all()  # nothing half-applied
    assert {q: (st.state(q), st.stats(q), st.snapshot(q)) for q in (0, 1)} == whole
    st.to_device([1, 0], tokens=table)  # sequence 1 a valid part of every call below
    seen.append(table.copy())
    a = st.step_many([1, 0], [0, 0])
    va = a.verify_slots[0]
    table[va[va >= 0]] = 500 + np.flatnonzero(va >= 0)  # sequence 1's verify batch, its ids written
    b = st.step_many([1, 0], [0, 0])  # confirms a's verify rows: sequence 0's ids were never written
    assert (a.status == STEP_OK).all() and (b.status == STEP_OK).all()
    vb = b.verify_slots[0]
    table[vb[vb >= 0]] = 600 + np.flatnonzero(vb >= 0)
    state = getattr(st, "step_state", None)  # the core's step state (the twin keeps its own Seqs)
    before, state = table.copy(), None if state is None else state.copy()
    refused(ValueError, st.to_host, [1, 0], tokens=table)
    refused(ValueError, st.to_host, [1, 0])
    assert st.on_device(0) and st.on_device(1) and (table == before).all()
    if state is not None:  # nothing brought back, nothing changed
        np.testing.assert_array_equal(st.step_state, state)
    table[a.verify_slots[1, 0]] = 1234  # accept 0 kept the first row of a's verify batch
    st.to_host([1, 0], [None, "crop"], tokens=table)  # 0's round failed: its verify rows stay unwritten
    assert st.state(0)["reservation_open"]
    st.confirm(1)
    seen.append(st.tokens(1, 0, st.state(1)["end"]))
    refused(ValueError, st.confirm, 0)
    refused(ValueError, st.confirm_many, [0])
    assert st.state(0)["reservation_open"]
    seen.append(st.tokens(0, st.state(0)["horizon"], st.state(0)["end"]))
    st.cancel(0)
    seen.append(st.tokens(0, 0, st.state(0)["end"]))
    return msgs, seen


def test_chain_token_table_refusals_and_hand_overs():
    """A chain drafter's slot token table: every refusal changes nothing and names its
    cause, the core's messages are the twin's, and the ids that come back are the ones the
    table held at the rows' slots."""
    core, twin = _chain_table_script(Stager), _chain_table_script(ReferenceStager)
    assert core[0] == twin[0]
    for x, y in zip(core[1], twin[1]):
        np.testing.assert_array_equal(x, y)
    msgs, seen = core
    rr = Stager(config(3, 2, 9, kind="chain")).ring_rows
    assert "it needs the slot token table (tokens: int32" in msgs[0]
    assert "numpy int32 array" in msgs[1] and "must be int32, got dtype int64" in msgs[2]
    assert "1-D C-contiguous" in msgs[3] and "1-D C-contiguous" in msgs[4] and "writable" in msgs[5]
    assert f"holds {3 * rr - 1} ids; it needs one per global slot, max_seqs * ring_rows = {3 * rr}" in msgs[6]
    assert 'kept for a chain drafter (kind="chain") only' in msgs[7] and "appears twice" in msgs[8]
    assert "to_host: seqs[1] (sequence 0): the slot token table holds -1 at slot" in msgs[9]
    assert "the row of position 6" in msgs[9] and "nothing was brought back" in msgs[9]
    assert "it needs the slot token table" in msgs[10]
    assert "sequence 0's reserved row at position 7 has no token id" in msgs[11] and "cancel" in msgs[11]
    assert msgs[12].startswith("confirm_many: seqs[0] (sequence 0): ")
    # The hand-over wrote sequences 0 and 1's ids at their rows' slots, -1 at their others,
    # and left sequence 2's slots alone.
    handed = seen[0]
    for q, n in ((0, 6), (1, 3)):
        mine = handed[q * rr:(q + 1) * rr]
        assert sorted(mine[mine >= 0].tolist()) == list(range(40, 40 + n)) and (mine[mine < 0] == -1).all()
    assert (handed[2 * rr:] == 77).all()
    # Sequence 1 came back with the ids written at its verify slots, and confirmed them.
    assert seen[1].tolist() == [40, 41, 42, 500, 600, 601, 602]
    assert seen[2][:7].tolist() == list(range(40, 46)) + [1234] and (seen[2][7:] == -1).all()
    assert seen[3].tolist() == list(range(40, 46)) + [1234]


@pytest.mark.parametrize("close", ["cancel", "confirm"])
def test_a_long_reservation_handed_over_keeps_every_rows_id(close):
    """A chain drafter's reservation longer than the window takes the slots of rows before
    it: handed over, the table holds the reserved rows' ids there (the ones the step reads);
    back on the host, confirm keeps those ids and cancel puts the earlier rows' back: the
    twin as the core."""
    ids = lambda pos: (7 * np.asarray(pos) + 3).astype(np.int32)  # noqa: E731 - the row at p has id 7p + 3
    got = []
    for cls in (Stager, ReferenceStager):
        st = cls(StagerConfig(feature_dim=32, block_size=1, window=3, max_seqs=1, rows="external", kind="chain"))
        prompt(st, 0, 0, 5, ids)
        st.reserve(0, np.arange(5, 9), tokens=ids(np.arange(5, 9)))  # window + 1 rows
        table = st.new_token_table()
        st.to_device([0], tokens=table)
        handed = table.copy()
        st.to_host([0], tokens=table)
        getattr(st, close)(0)
        s = st.state(0)
        got.append((handed, st.tokens(0, s["horizon"], s["end"]), s))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    assert got[0][2] == got[1][2]
    s = got[0][2]
    np.testing.assert_array_equal(got[0][1], ids(np.arange(s["horizon"], s["end"])))  # each row its own id


@pytest.mark.parametrize("then", ["confirm", "cancel"])
def test_a_block_stagers_failed_round_comes_back_holding_its_verify_rows(then):
    """protocol.md 2.10: a block drafter's Stager keeps no ids, so after a failure hand-back its
    last step's verify rows come back reserved: ``confirm`` them when the verify forward ran
    anyway (a captured graph runs it whatever the drafts), ``cancel`` them otherwise. Either
    way the Stager is what the host path makes of the same calls (fail, reserve, then the
    same confirm or cancel), and the next round plans alike."""
    cfg = config(2, 3, 16)
    dev, orc = Stager(cfg), Stager(cfg)
    for st in (dev, orc):
        prompt(st, 0, 0, 9)
    dev.to_device([0])
    dev.step_many([0], [0])
    dev.to_host([0], ["decode"])
    host_step(orc, 0, 0, "decode")
    same_seq(dev, orc, 0)
    assert dev.state(0)["reservation_open"] and dev.stats(0)["failures"] == 1
    for st in (dev, orc):
        getattr(st, then)(0)
    same_seq(dev, orc, 0)
    end = dev.state(0)["end"]
    assert end == (9 + cfg.block_size + 1 if then == "confirm" else 9)
    for st in (dev, orc):
        st.accept(0, 0)
    plans = [st.draft(0, st.state(0)["end"]) for st in (dev, orc)]
    assert plans[0].skip is None and plans[0].rebase  # a failure owes a restage
    np.testing.assert_array_equal(plans[0].slots, plans[1].slots)
    assert plans[0].pos_base == plans[1].pos_base
