"""A chain drafter's Stager (``StagerConfig(kind="chain")``): the token id kept beside each row.

EAGLE-3, EAGLE and MTP heads pair each captured row with the id of the token
after it. The Stager keeps, beside every row, the id of the token the target
read at the row's position (``process(..., tokens=)``); plans carry the ids of
their staged rows (``plan.tokens``) and ``plan.successors(next_token)`` pairs
each row with the one after it.

The backbone is a random walk of calls driven into four Stagers at once: the
core and the reference twin, each in held and external-row mode (the test
owns the external rows' table and applies every move). Every row carries its
own token id in channel 0 (exact in f32), so a second oracle needs no model at
all: the ids a plan hands out must be the ones written with the very rows it
stages (held: ``plan.rows[:, 0]``; external: the owner's table at
``plan.slots``). The walk covers rounds that rebase and wrap the ring,
failures, accepts, rollbacks, shifts, forks, snapshots restored across
sequences, and the batched calls.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import Stager, StagerConfig
from dspark_core.errors import ConfigError, StateError
from dspark_core.reference import ReferenceStager
from dspark_core.stager import snapshot_format

D, B, W, SEQS = 32, 3, 24, 3


def config(rows: str = "held", kind: str = "chain") -> StagerConfig:
    return StagerConfig(D, B, W, max_seqs=SEQS, rows=rows, kind=kind)


def rows_with_ids(rng: np.random.Generator, ids: np.ndarray) -> np.ndarray:
    """Activation-like rows (massive channels, f32) whose channel 0 holds each row's token id."""
    x = massive_rows(rng, len(ids), D)
    x[:, 0] = ids.astype(np.float32)
    return x


def frozen(s, seq: int):
    """What a refused call must leave as it was: the sequence's state, its counters and its snapshot's
    bytes (which carry the ids; none while a round, a tree or a reservation is open)."""
    st = s.state(seq)
    snap = None if st["open_round"] or st["tree_nodes"] or st["reservation_open"] else s.snapshot(seq)
    return st, s.stats(seq), snap


class Quad:
    """The same calls into the core and the twin, held and external (with the owner's table)."""

    def __init__(self) -> None:
        self.held = [Stager(config()), ReferenceStager(config())]
        self.ext = [Stager(config("external")), ReferenceStager(config("external"))]
        ring = config().ring_rows
        self.tables = [np.full((SEQS * ring, D), np.nan, np.float32) for _ in self.ext]

    def all(self):
        return self.held + self.ext

    def call(self, name: str, *args, **kw):
        """Call every Stager; all must raise the same error or all return; returns the results."""
        out = []
        for s in self.all():
            try:
                out.append(("ok", getattr(s, name)(*args, **kw)))
            except (ValueError, TypeError, StateError) as exc:
                out.append(("raise", (type(exc), str(exc))))
        kinds = {o[0] for o in out}
        assert len(kinds) == 1, (name, out)
        if out[0][0] == "raise":
            assert len({o[1] for o in out}) == 1, (name, out)
        return out

    def process(self, seq: int, pos: np.ndarray, ids: np.ndarray, rows: np.ndarray):
        for s in self.held:
            s.process(seq, pos, rows, tokens=ids)
        for s, t in zip(self.ext, self.tables):
            slots = s.process(seq, pos, tokens=ids)
            t[slots[slots >= 0]] = rows[slots >= 0]

    def apply(self, results) -> None:
        """Apply the moves the external Stagers returned (fork / shift / restore), in order."""
        for (kind, moves), t in zip(results[2:], self.tables):
            if kind == "ok" and moves is not None and len(moves):
                for src, dst, n in np.asarray(moves).reshape(-1, 3).tolist():
                    t[dst:dst + n] = t[src:src + n].copy()

    def check(self) -> None:
        for seq in range(SEQS):
            states = [s.state(seq) for s in self.all()]
            assert all(st == states[0] for st in states), states
            lo, hi = self.held[0].buffered_positions(seq)
            ids = [s.tokens(seq, lo, hi) for s in self.all()]
            for x in ids[1:]:
                np.testing.assert_array_equal(x, ids[0])


def test_chain_staging_matches_the_twin_and_keeps_each_id_with_its_row():
    rng = np.random.default_rng(7)
    q = Quad()
    next_id = 1
    ends = [0] * SEQS
    for seq in range(SEQS):
        q.call("begin", seq)
    for _ in range(700):
        seq = int(rng.integers(SEQS))
        op = rng.choice(["round", "round", "round", "prefill", "rollback", "shift", "fork", "migrate", "fail",
                         "batch"])
        end = q.held[0].state(seq)["end"]
        if op == "prefill" or end == 0:
            n = int(rng.integers(1, 2 * W))
            ids = np.arange(next_id, next_id + n, dtype=np.int32)
            next_id += n
            q.process(seq, np.arange(end, end + n), ids, rows_with_ids(rng, ids))
        elif op in ("round", "fail"):
            plans = q.call("draft", seq, end)
            plan = plans[0][1]
            for _, p in plans[1:]:
                assert (p.skip, p.rebase, p.positions.tolist()) == (plan.skip, plan.rebase, plan.positions.tolist())
                np.testing.assert_array_equal(p.tokens, plan.tokens)
            if plan.skip is None:
                # The ids travel with their rows: the held rows' channel 0, the owner's table at the slots.
                np.testing.assert_array_equal(plan.rows[:, 0].astype(np.int64), plan.tokens)
                for (_, p), t in zip(plans[2:], q.tables):
                    np.testing.assert_array_equal(t[p.slots, 0].astype(np.int64), p.tokens)
                root = next_id
                succ = plan.successors(root)
                np.testing.assert_array_equal(succ[:-1], plan.tokens[1:])
                assert succ[-1] == root if len(succ) else True
                q.call("fail" if op == "fail" else "commit", seq)
            n = B + 1
            ids = np.arange(next_id, next_id + n, dtype=np.int32)
            next_id += n
            q.process(seq, np.arange(end, end + n), ids, rows_with_ids(rng, ids))
            q.call("accept", seq, int(rng.integers(0, B + 1)))
        elif op == "rollback":
            q.call("rollback", seq, int(rng.integers(0, end + 1)))
        elif op == "shift":
            keep = int(rng.integers(0, end + 1))
            q.apply(q.call("shift", seq, keep, int(rng.integers(0, end - keep + 1))))
        elif op == "fork":
            dst = (seq + 1) % SEQS
            q.apply(q.call("fork", seq, dst))
        elif op == "migrate":
            dst = (seq + 2) % SEQS
            snaps = [s.snapshot(seq) for s in q.all()]
            assert snaps[0] == snaps[1] and snaps[2] == snaps[3]
            results = []
            for s, data in zip(q.all(), snaps):
                results.append(("ok", s.restore(dst, data)))
            # External: the owner copies the saved rows into the slots restore returned.
            for (_, slots), s, t in zip(results[2:], q.ext, q.tables):
                lo, hi = s.buffered_positions(seq)
                t[np.asarray(slots)] = t[s.live_slots(seq)]
        elif op == "batch":
            seqs = np.array([x for x in range(SEQS) if q.held[0].state(x)["started"]], np.int64)
            if len(seqs) == 0:
                continue
            counts = rng.integers(1, 4, len(seqs))
            cu = np.concatenate([[0], np.cumsum(counts)])
            pos = np.concatenate([np.arange(q.held[0].state(int(s))["end"], q.held[0].state(int(s))["end"] + c)
                                  for s, c in zip(seqs, counts)])
            ids = np.arange(next_id, next_id + len(pos), dtype=np.int32)
            next_id += len(pos)
            rows = rows_with_ids(rng, ids)
            for s in q.held:
                s.process_many(seqs, cu, pos, rows, tokens=ids)
            for s, t in zip(q.ext, q.tables):
                slots = s.process_many(seqs, cu, pos, tokens=ids)
                t[slots[slots >= 0]] = rows[slots >= 0]
            starts = np.array([q.held[0].state(int(s))["end"] for s in seqs])
            batch = [s.draft_many(seqs, starts) for s in q.all()]
            for b in batch[1:]:
                np.testing.assert_array_equal(b.tokens, batch[0].tokens)
            active = batch[0].active
            np.testing.assert_array_equal(batch[0].rows[:, 0].astype(np.int64), batch[0].tokens)
            for b, t in zip(batch[2:], q.tables):
                np.testing.assert_array_equal(t[b.slots, 0].astype(np.int64), b.tokens)
            for i, p in enumerate(batch[0].plans):  # the per-sequence view slices the flat ids
                np.testing.assert_array_equal(p.tokens, q.held[1].tokens(int(seqs[i]), p.start - len(p.tokens),
                                                                         p.start) if p.skip is None else [])
            q.call("commit_many", seqs[active])
        q.check()
        ends = [q.held[0].state(x)["end"] for x in range(SEQS)]
    assert max(ends) > 3 * W  # the walk went well past the window


def test_token_arguments_are_checked_and_a_rejected_call_changes_nothing():
    q = Quad()
    q.call("begin", 0)
    ids = np.arange(4, dtype=np.int32) + 10
    q.process(0, np.arange(4), ids, rows_with_ids(np.random.default_rng(0), ids))
    before = [s.snapshot(0) for s in q.all()]
    pos = np.arange(4, 6)
    rows = np.zeros((2, D), np.float32)
    cases = [
        dict(),  # a chain drafter's rows need their ids
        dict(tokens=[5, -1]),  # ids are >= 0
        dict(tokens=[5]),  # one per row
        dict(tokens=[5.0, 6.0]),  # integers
        dict(tokens=[[5, 6]]),  # 1-D
        dict(tokens=[5, 2**31]),  # int32
    ]
    for kw in cases:
        errors = set()
        for s in q.held:
            with pytest.raises((ValueError, TypeError)) as e:
                s.process(0, pos, rows, **kw)
            errors.add((e.type, str(e.value)))
        for s in q.ext:
            with pytest.raises((ValueError, TypeError)) as e:
                s.process(0, pos, **kw)
            errors.add((e.type, str(e.value)))
        assert len(errors) == 1, (kw, errors)
    # The batch form names the call and the flat index.
    for s in q.held:
        with pytest.raises(ValueError, match=r"process_many: tokens\[1\] is -4: token ids are >= 0"):
            s.process_many([0], [0, 2], pos, rows, tokens=[3, -4])
    assert [s.snapshot(0) for s in q.all()] == before
    # A block drafter's Stager keeps no ids: tokens are refused, not dropped.
    for s in (Stager(config(kind="block")), ReferenceStager(config(kind="block"))):
        s.begin(0)
        with pytest.raises(ValueError, match='kept for a chain drafter .kind="chain". only'):
            s.process(0, [0], np.zeros((1, D), np.float32), tokens=[1])
        assert s.state(0)["end"] == 0
        with pytest.raises(ValueError, match="token ids are kept for a chain drafter"):
            s.tokens(0, 0, 0)


def test_calls_that_carry_no_ids_refuse_a_chain_drafters_stager_and_trees_take_them():
    held = [Stager(config()), ReferenceStager(config())]
    ext = [Stager(config("external")), ReferenceStager(config("external"))]
    for s in held + ext:
        s.begin(0)
        s.process(0, [0, 1], None if s in ext else np.zeros((2, D), np.float32), tokens=[1, 2])
        p = s.draft(0, 2)
        s.commit(0)
        assert p.tokens.tolist() == [1, 2]
    for s in ext:  # the device step takes the ids in a slot token table (test_device_step.py)
        with pytest.raises(ValueError, match=r"^to_device: a chain drafter's Stager hands .* it needs the slot token table \(tokens: int32"):
            s.to_device([0])
        assert not s.on_device(0)
    for s in held + ext:
        rows = None if s in ext else np.zeros((3, D), np.float32)
        before = frozen(s, 0)
        assert before[2] is not None  # a snapshot to compare
        with pytest.raises(ValueError, match="needs the token id of every row"):
            s.process_tree(0, 2, [-1, 0, 0], rows)
        with pytest.raises(ValueError, match="needs the token id of every row"):
            s.check_process_tree(0, 2, [-1, 0, 0])
        # A bad id, or not one per node: refused, with nothing changed (state, counters, snapshot bytes).
        with pytest.raises(ValueError, match=r"tokens\[1\] is -1: token ids are >= 0"):
            s.process_tree(0, 2, [-1, 0, 0], rows, tokens=[30, -1, 32])
        with pytest.raises(ValueError, match=r"tokens\[2\] is -5"):
            s.check_process_tree(0, 2, [-1, 0, 0], [30, 31, -5])
        with pytest.raises(ValueError, match="2 token ids for 3 rows"):
            s.process_tree(0, 2, [-1, 0, 0], rows, tokens=[30, 31])
        with pytest.raises(ValueError, match=r"process_tree_many: tokens\[0\] is -2"):
            s.process_tree_many([0], [0, 3], [2], [-1, 0, 0], rows, tokens=[-2, 31, 32])
        with pytest.raises(ValueError, match="process_tree_many: a chain drafter's Stager"):
            s.process_tree_many([0], [0, 3], [2], [-1, 0, 0], rows)
        assert frozen(s, 0) == before
        assert s.state(0)["end"] == 2 and s.state(0)["tree_nodes"] == 0
        # A tree of [last, a, b] (a and b siblings): the path through b keeps b's id at position 3.
        s.check_process_tree(0, 2, [-1, 0, 0], [30, 31, 32])
        s.process_tree(0, 2, [-1, 0, 0], rows, tokens=[30, 31, 32])
        s.accept_path(0, [0, 2])
        assert s.tokens(0, 0, 4).tolist() == [1, 2, 30, 32]
        # process_tree_many: the ids flat as the nodes.
        s.draft(0, 4)
        s.commit(0)
        rows = None if s in ext else np.zeros((2, D), np.float32)
        s.process_tree_many([0], [0, 2], [4], [-1, 0], rows, tokens=[40, 41])
        s.accept_path(0, [0, 1])
        assert s.tokens(0, 0, 6).tolist() == [1, 2, 30, 32, 40, 41]
    for s in ext:
        # A reservation takes the ids with the slots; cancel takes both back, confirm keeps them.
        # Without them, with a bad one or with one too many, it is refused and nothing changed.
        before = frozen(s, 0)
        with pytest.raises(ValueError, match="needs the token id of every row"):
            s.reserve(0, [6])
        with pytest.raises(ValueError, match=r"tokens\[1\] is -1: token ids are >= 0"):
            s.reserve(0, [6, 7], tokens=[3, -1])
        with pytest.raises(ValueError, match="3 token ids for 2 rows"):
            s.reserve(0, [6, 7], tokens=[3, 4, 5])
        with pytest.raises(ValueError, match=r"reserve_many: tokens\[0\] is -7"):
            s.reserve_many([0], [0, 1], [6], tokens=[-7])
        with pytest.raises(ValueError, match="reserve_many: a chain drafter's Stager"):
            s.reserve_many([0], [0, 1], [6])
        assert frozen(s, 0) == before
        assert not s.state(0)["reservation_open"]
        s.reserve(0, [6], tokens=[3])
        s.cancel(0)
        assert s.state(0)["end"] == 6
        s.reserve_many([0], [0, 1], [6], tokens=[4])
        s.confirm(0)
        assert s.tokens(0, 0, 7).tolist() == [1, 2, 30, 32, 40, 41, 4]
    # The core and the twin agree on every refusal's aftermath, snapshot bytes and counters alike.
    for a, b in (held, ext):
        assert frozen(a, 0)[2] == frozen(b, 0)[2]
        assert a.state(0) == b.state(0)


@pytest.mark.parametrize("rows", ["held", "external"])
def test_a_block_drafters_stager_refuses_ids_on_trees_and_reservations_changing_nothing(rows):
    """tokens= on a block drafter's Stager: process_tree(_many), check_process_tree, reserve(_many)
    refuse them (ValueError), leaving state, counters and snapshot bytes as they were."""
    ext = rows == "external"
    for s in (Stager(config(rows, "block")), ReferenceStager(config(rows, "block"))):
        s.begin(0)
        s.process(0, [0, 1], None if ext else np.zeros((2, D), np.float32))
        s.draft(0, 2)
        s.commit(0)
        before = frozen(s, 0)
        tree_rows = None if ext else np.zeros((2, D), np.float32)
        calls = [("process_tree", (0, 2, [-1, 0], tree_rows), [1, 2]),
                 ("check_process_tree", (0, 2, [-1, 0]), [1, 2]),
                 ("process_tree_many", ([0], [0, 2], [2], [-1, 0], tree_rows), [1, 2])]
        if ext:
            calls += [("reserve", (0, [2]), [1]), ("reserve_many", ([0], [0, 1], [2]), [1])]
        for name, args, ids in calls:
            with pytest.raises(ValueError, match='kept for a chain drafter .kind="chain". only'):
                getattr(s, name)(*args, tokens=ids)
            assert frozen(s, 0) == before, name
        s.process_tree(0, 2, [-1, 0], tree_rows)  # without them: taken
        assert s.state(0)["tree_nodes"] == 2


def test_snapshots_carry_the_ids_and_refuse_the_other_kind():
    chain = [Stager(config()), ReferenceStager(config())]
    block = [Stager(config(kind="block")), ReferenceStager(config(kind="block"))]
    rows = np.zeros((5, D), np.float32)
    for s in chain:
        s.begin(0)
        s.process(0, np.arange(5), rows, tokens=[9, 8, 7, 6, 5])
    for s in block:
        s.begin(0)
        s.process(0, np.arange(5), rows)
    snap = chain[0].snapshot(0)
    assert snap == chain[1].snapshot(0)
    assert chain[0].snapshot_size(0) == chain[1].snapshot_size(0) == len(snap)
    assert len(snap) == len(block[0].snapshot(0)) + 5 * 4
    assert snapshot_format.unpack(snap, config().snapshot_fingerprint(), tokens=True).tokens == \
        np.array([9, 8, 7, 6, 5], "<i4").tobytes()
    for s in block:
        with pytest.raises(ValueError, match=r"carries token ids \(taken by a chain drafter's Stager"):
            s.restore(1, snap)
    for s in chain:
        with pytest.raises(ValueError, match=r"carries no token ids \(taken by a block drafter's Stager"):
            s.restore(1, block[0].snapshot(0))
        # A damaged id is a damaged snapshot; a negative one (checksums redone) is inconsistent.
        bad = bytearray(snap)
        bad[-1] ^= 1
        with pytest.raises(ValueError, match="rows checksum mismatch"):
            s.restore(1, bytes(bad))
        bad[-4:] = (-3).to_bytes(4, "little", signed=True)
        snapshot_format.refresh_checksums(bad)
        with pytest.raises(ValueError, match=r"token ids are inconsistent \(a negative id\)"):
            s.check_restore(1, bytes(bad))
        with pytest.raises(ValueError, match=r"token ids are inconsistent \(a negative id\)"):
            s.restore(1, bytes(bad))
        assert not s.state(1)["started"]
        s.restore(1, snap)
        assert s.tokens(1, 0, 5).tolist() == [9, 8, 7, 6, 5]


def test_kind_is_configuration():
    with pytest.raises(ConfigError, match="kind 'tree' is not a drafter kind"):
        StagerConfig(D, B, W, kind="tree")
    assert StagerConfig(D, B, W, kind="chain").chain and not StagerConfig(D, B, W).chain
    s = Stager(config())
    s.begin(0)
    s.process(0, [0, 1, 2], np.zeros((3, D), np.float32), tokens=[4, 5, 6])
    t = pickle.loads(pickle.dumps(s))  # the kind and the ids travel with the Stager
    assert t.config.kind == "chain" and t.tokens(0, 0, 3).tolist() == [4, 5, 6]
    plan = t.draft(0, 3)
    assert plan.successors(7).tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="next_token must be a token id"):
        plan.successors(-1)
    t.commit(0)
    skipped = t.draft(0, 3)  # nothing new since the commit
    assert skipped.skip == "no_context" and skipped.tokens.tolist() == []
    bp = Stager(config(kind="block"))
    bp.begin(0)
    bp.process(0, [0, 1], np.zeros((2, D), np.float32))
    block_plan = bp.draft(0, 2)
    assert block_plan.tokens is None
    with pytest.raises(ValueError, match="block drafter's Stager, which keeps no token ids"):
        block_plan.successors(1)


@pytest.mark.parametrize("rows", ["held", "external"])
def test_a_prefix_hit_takes_the_prompts_ids(rows):
    """The store keeps rows, not ids (its keys are made of the tokens): a chain drafter's
    hit takes the prompt's ids, and the rows it brings back carry them, as after a prefill."""
    from dspark_core import PrefixStore
    from dspark_core.reference import ReferencePrefixStore

    cfg = config(rows).replace(window=96)  # the whole prompt held: every block can be published
    prompt = np.arange(100, 140, dtype=np.int32)
    keys = list(range(1, 11))  # one key per 4-token block
    results = []
    for st, store in ((Stager(cfg), PrefixStore(cfg, 4, 1 << 20)), (ReferenceStager(cfg), ReferencePrefixStore(cfg, 4, 1 << 20))):
        st.begin(0)
        st.process(0, np.arange(40), None if rows == "external" else rows_with_ids(np.random.default_rng(1), prompt),
                   tokens=prompt)
        store.publish(st, 0, keys, 0, 40)  # a chain Stager publishes its rows as any
        st.begin(1)
        before, before2, store_before = frozen(st, 1), frozen(st, 2), (store.keys(), store.stats())
        with pytest.raises(ValueError, match="needs the token id of every row"):
            store.hit(st, 1, keys, 40)
        with pytest.raises(ValueError, match=r"tokens\[3\] is -1"):
            store.hit(st, 1, keys, 40, tokens=np.where(np.arange(40) == 3, -1, prompt))
        with pytest.raises(ValueError, match="41 token ids for 40 rows"):
            store.hit(st, 1, keys, 40, tokens=np.append(prompt, 1))
        with pytest.raises(ValueError, match=r"hit_many: tokens\[45\] is -9"):  # the batch: flat in batch order
            store.hit_many(st, [1, 2], [keys, keys[:5]], [40, 20],
                           tokens=np.concatenate([prompt, np.where(np.arange(20) == 5, -9, prompt[:20])]))
        with pytest.raises(ValueError, match="needs the token id of every row"):
            store.hit_many(st, [1], [keys], [40])
        assert not st.state(1)["started"]
        assert frozen(st, 1) == before and frozen(st, 2) == before2
        assert (store.keys(), store.stats()) == store_before  # no hit counted
        hit = store.hit(st, 1, keys, 40, tokens=prompt)
        assert hit.replay_from > hit.first_row >= 0
        got = st.tokens(1, hit.first_row, hit.replay_from)
        np.testing.assert_array_equal(got, prompt[hit.first_row:hit.replay_from])
        # The batched hit: the ids flat in batch order.
        st.begin(2)
        hits = store.hit_many(st, [2], [keys[:5]], [20], tokens=prompt[:20])
        h2 = hits.hits[0] if hasattr(hits, "hits") else hits[0]
        np.testing.assert_array_equal(st.tokens(2, h2.first_row, h2.replay_from), prompt[h2.first_row:h2.replay_from])
        results.append((hit.first_row, hit.replay_from, got.tolist(), st.state(1)))
    assert results[0] == results[1]
    block = cfg.replace(kind="block")
    st, store = Stager(block), PrefixStore(block, 4, 1 << 20)
    st.begin(0)
    with pytest.raises(ValueError, match="kept for a chain drafter"):
        store.hit(st, 0, keys, 40, tokens=prompt)


@pytest.mark.parametrize("rows", ["held", "external"])
def test_the_invariant_checker_passes_a_chain_drafters_ids_on(rows):
    """A chain drafter's loop runs under InvariantChecker: the ids reach the Stager (which keeps
    them), while the checker checks its invariants of the rows."""
    from dspark_core.testing import InvariantChecker

    cfg = config(rows)
    chk = InvariantChecker(Stager(cfg))
    chk.begin(0)
    x = rows_with_ids(np.random.default_rng(2), np.arange(5, dtype=np.int32))
    with pytest.raises(ValueError, match="needs the token id of every row"):
        chk.process(0, np.arange(5), x)
    chk.process(0, np.arange(5), x, tokens=np.arange(10, 15))
    chk.process_many([0], [0, 2], [5, 6], x[:2], tokens=[15, 16])
    assert chk.draft(0, 7).tokens.tolist() == list(range(10, 17))
    chk.commit(0)
    if rows == "held":  # a chain drafter's snapshot restores under the checker, ids and all
        chk.restore(1, chk.snapshot(0))
        assert chk.tokens(1, 0, 7).tolist() == list(range(10, 17))


@pytest.mark.parametrize("cls", [Stager, ReferenceStager], ids=["core", "reference"])
def test_a_batch_plans_successors_are_each_sequences_own(cls):
    """BatchPlan.successors(lasts): the flat successors of every sequence, equal to each
    sequence's own StagePlan.successors(last) (a skipped sequence has no rows and needs no
    last); bad lasts refused."""
    st = cls(StagerConfig(feature_dim=16, block_size=2, window=9, max_seqs=4, rows="external", kind="chain"))
    for q, n in ((0, 5), (1, 12), (3, 7)):
        st.begin(q)
        st.process(q, np.arange(n), tokens=np.arange(n) * 10 + q)
    plan = st.draft_many([0, 1, 2, 3], [5, 12, 0, 7])
    lasts = np.array([501, 502, -3, 504])  # sequence 2 is skipped (empty): its last is never read
    got = plan.successors(lasts)
    offs = plan.row_offsets
    for i, q in enumerate(plan.seqs.tolist()):
        p = plan.plan(q)
        want = p.successors(int(lasts[i])) if p.skip is None else np.zeros(0, np.int32)
        np.testing.assert_array_equal(got[offs[i]:offs[i + 1]], want)
    with pytest.raises(ValueError, match="4 sequences for lasts of shape"):
        plan.successors([1, 2])
    with pytest.raises(ValueError, match=r"lasts\[1\] must be a token id"):
        plan.successors([1, -1, 3, 4])
    block = cls(StagerConfig(feature_dim=16, block_size=2, window=9, max_seqs=1, rows="external"))
    block.begin(0)
    block.process(0, np.arange(5))
    with pytest.raises(ValueError, match="block drafter"):
        block.draft_many([0], [5]).successors([1])
