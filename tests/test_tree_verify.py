"""Tree verification (docs/design.md 2.11): trees and paths == a linear verify of the accepted tokens.

Two Stagers of one configuration run the same request. One verifies each
round as a random draft tree (``process_tree``) and keeps a random
root-to-node path (``accept_path``); the other verifies the same round
linearly: the path's rows first, then the other nodes' rows, and
``accept(len(path) - 1)``. After every round both must agree on everything a
server sees: the state, the counters and the acceptance histogram, the
snapshot (every stageable row, byte for byte), and the next plan (its rows,
or in external-row mode its slots and what the owner's table holds there
once it applied the moves accept_path returned). The core and the reference
twin are both checked, and the twin against the core on the same calls.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.errors import StateError
from dspark_core.reference import ReferenceStager
from conftest import massive_rows

B, W, D = 4, 24, 32


def random_tree(rng, n):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def random_path(rng, parents):
    node = int(rng.integers(0, len(parents)))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class Owner:
    """An owner of external rows: the slot table, the rows written where process says, moves applied."""

    def __init__(self, st):
        self.table = np.full((st.config.max_seqs * st.ring_rows, D), np.nan, np.float32)

    def write(self, slots, rows):
        keep = slots >= 0
        self.table[slots[keep]] = rows[keep]

    def apply(self, moves):
        for src, dst, count in moves:
            self.table[dst:dst + count] = self.table[src:src + count].copy()


def same(st_a, st_b, own_a, own_b, seq, end):
    """Everything a server sees of seq agrees; then both draft the next round the same way."""
    assert st_a.state(seq) == st_b.state(seq)
    assert st_a.stats(seq) == st_b.stats(seq)
    assert np.array_equal(st_a.accepted(seq), st_b.accepted(seq))
    assert st_a.snapshot(seq) == st_b.snapshot(seq)
    pa, pb = st_a.draft(seq, end), st_b.draft(seq, end)
    assert (pa.skip, pa.start, pa.rebase, pa.pos_base) == (pb.skip, pb.start, pb.rebase, pb.pos_base)
    np.testing.assert_array_equal(pa.positions, pb.positions)
    np.testing.assert_array_equal(pa.slots, pb.slots)
    if own_a is None:
        assert pa.encoded_rows.tobytes() == pb.encoded_rows.tobytes()
    else:
        np.testing.assert_array_equal(own_a.table[pa.slots], own_b.table[pb.slots])
    return pa


@pytest.mark.parametrize("impl", [Stager, ReferenceStager], ids=["core", "twin"])
@pytest.mark.parametrize("rows", ["held", "external"])
@pytest.mark.parametrize("storage", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("seed", range(4))
def test_trees_and_paths_equal_a_linear_verify(impl, rows, storage, seed):
    rng = np.random.default_rng(seed)
    cfg = StagerConfig(D, B, W, max_seqs=2, storage=storage, rows=rows)
    tree_st, line_st = impl(cfg), impl(cfg)
    ext = rows == "external"
    own_t, own_l = (Owner(tree_st), Owner(line_st)) if ext else (None, None)
    seq = int(rng.integers(0, 2))
    prompt = massive_rows(rng, 30, D)

    def process(st, own, pos, x):
        if ext:
            own.write(st.process(seq, pos), x)
        else:
            st.process(seq, pos, x)

    for st, own in ((tree_st, own_t), (line_st, own_l)):
        st.begin(seq)
        process(st, own, np.arange(30), prompt)
    end = 30
    for _ in range(25):  # past the window: rebases, trims and ring wraps on the way
        plan = same(tree_st, line_st, own_t, own_l, seq, end)
        if plan.skip is None:
            tree_st.commit(seq)
            line_st.commit(seq)
        n = int(rng.integers(1, B + 2))
        parents = random_tree(rng, n)
        x = massive_rows(rng, n, D)
        path = random_path(rng, parents)
        if ext:
            own_t.write(tree_st.process_tree(seq, end, parents), x)
        else:
            tree_st.process_tree(seq, end, parents, x)
        assert tree_st.state(seq)["tree_nodes"] == n
        moves = tree_st.accept_path(seq, path)
        if ext:
            own_t.apply(moves)
        # The linear twin: the path's rows first, the other nodes after them.
        order = path + [k for k in range(n) if k not in path]
        process(line_st, own_l, np.arange(end, end + n), x[order])
        line_st.accept(seq, len(path) - 1)
        end += len(path)
    same(tree_st, line_st, own_t, own_l, seq, end)


@pytest.mark.parametrize("rows", ["held", "external"])
def test_core_and_twin_return_the_same_moves(rows):
    """The copies accept_path returns, and their serials, are the twin's (paths that move rows across a wrap)."""
    rng = np.random.default_rng(7)
    cfg = StagerConfig(D, B, W, max_seqs=3, rows=rows)
    core, twin = Stager(cfg), ReferenceStager(cfg)
    prompts = [massive_rows(rng, 5 + s, D) for s in range(3)]
    ends = {s: len(prompts[s]) for s in range(3)}
    for st in (core, twin):
        for s in range(3):
            st.begin(s)
            pos = np.arange(ends[s])
            st.process(s, pos) if rows == "external" else st.process(s, pos, prompts[s])
    for r in range(40):
        trees, paths = {}, {}
        for s in range(3):
            n = int(rng.integers(1, B + 2))
            trees[s] = random_tree(rng, n)
            paths[s] = random_path(rng, trees[s])
        x = {s: massive_rows(rng, len(trees[s]), D) for s in range(3)}
        slots = []
        for st in (core, twin):
            for s in range(3):
                st.draft(s, ends[s])
                if st.state(s)["open_round"]:
                    st.commit(s)
                if rows == "external":
                    slots.append(st.process_tree(s, ends[s], trees[s]))
                else:
                    st.process_tree(s, ends[s], trees[s], x[s])
        for s in range(len(slots) // 2):  # external rows: where each node's row goes
            assert np.array_equal(slots[s], slots[s + 3])
        if r % 2:
            cu = np.cumsum([0] + [len(paths[s]) for s in range(3)])
            flat = np.concatenate([paths[s] for s in range(3)])
            a, b = core.accept_path_many([0, 1, 2], cu, flat), twin.accept_path_many([0, 1, 2], cu, flat)
            assert np.array_equal(a, b) and a.serial == b.serial
        else:
            for s in range(3):
                a, b = core.accept_path(s, paths[s]), twin.accept_path(s, paths[s])
                assert np.array_equal(a, b) and a.serial == b.serial
                assert all(m[2] <= m[0] - m[1] for m in a)  # a plain copy: the ranges never overlap
        for s in range(3):
            ends[s] += len(paths[s])
            assert core.state(s) == twin.state(s)
            if rows == "held":
                assert core.snapshot(s) == twin.snapshot(s)
    assert core.moves_issued == twin.moves_issued > 0


def test_a_chain_shaped_tree_is_accept():
    """parents [-1, 0, 1, ...] and the path [0 .. k] leave exactly what process + accept(k) leaves."""
    rng = np.random.default_rng(3)
    cfg = StagerConfig(D, B, W)
    for k in range(B + 1):
        a, b = Stager(cfg), Stager(cfg)
        x = massive_rows(rng, 12 + B + 1, D)
        for st in (a, b):
            st.begin(0)
            st.process(0, np.arange(12), x[:12])
            st.draft(0, 12)
            st.commit(0)
        moves = a.process_tree(0, 12, [-1] + list(range(B)), x[12:]), a.accept_path(0, list(range(k + 1)))
        b.process(0, np.arange(12, 12 + B + 1), x[12:])
        b.accept(0, k)
        assert len(moves[1]) == 0 and moves[1].serial == 0  # a chain's path is where it lies
        assert a.state(0) == b.state(0) and a.stats(0) == b.stats(0) and a.snapshot(0) == b.snapshot(0)
        assert list(a.accepted(0)) == [int(j == k) for j in range(B + 1)]


def _tree_ready(impl, rows="held"):
    cfg = StagerConfig(D, B, W, max_seqs=2, rows=rows)
    st = impl(cfg)
    rng = np.random.default_rng(1)
    for s in range(2):
        st.begin(s)
        st.process(s, np.arange(10)) if rows == "external" else st.process(s, np.arange(10), massive_rows(rng, 10, D))
        st.draft(s, 10)
        st.commit(s)
    return st


def _looks(st):
    return [(st.state(s), st.stats(s), st.accepted(s).tolist(), st.snapshot(s) if not st.state(s)["tree_nodes"]
             else None) for s in range(2)], st.totals().stats, st.moves_issued


BAD_TREES = [
    ("cycle", [-1, 0, 2], ValueError, "parents[2] = 2: a node's parent is an earlier node"),
    ("parent after child", [-1, 2, 0], ValueError, "parents[1] = 2"),
    ("negative parent", [-1, 0, -3], ValueError, "parents[2] = -3"),
    ("no root", [0, 0], ValueError, "parents[0] must be -1"),
    ("two roots", [-1, -1], ValueError, "parents[1] = -1"),
    ("empty", [], ValueError, "holds 1 to 5 nodes"),
    ("too many", [-1] + [0] * (B + 1), ValueError, "holds 1 to 5 nodes"),
    ("not integers", [-1.0, 0.0], TypeError, "parents must be integers"),
]


@pytest.mark.parametrize("impl", [Stager, ReferenceStager], ids=["core", "twin"])
@pytest.mark.parametrize("name,parents,exc,words", BAD_TREES, ids=[t[0] for t in BAD_TREES])
def test_bad_trees_are_errors_that_change_nothing(impl, name, parents, exc, words):
    st = _tree_ready(impl)
    before = _looks(st)
    x = massive_rows(np.random.default_rng(0), len(parents), D)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        st.process_tree(0, 10, parents, x)
    assert _looks(st) == before
    st.process_tree(0, 10, [-1, 0, 0], x[:3] if len(x) >= 3 else massive_rows(np.random.default_rng(0), 3, D))


@pytest.mark.parametrize("impl", [Stager, ReferenceStager], ids=["core", "twin"])
def test_trees_at_the_wrong_time_or_place_change_nothing(impl):
    st = _tree_ready(impl)
    x = massive_rows(np.random.default_rng(0), 3, D)
    before = _looks(st)
    with pytest.raises(ValueError, match="root must stand at the sequence's end 10"):
        st.process_tree(0, 11, [-1, 0, 0], x)
    bad = x.copy()
    bad[2, 5] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        st.process_tree(0, 10, [-1, 0, 0], bad)
    with pytest.raises(ValueError, match="3 parents for 2 rows"):
        st.process_tree(0, 10, [-1, 0, 0], x[:2])
    with pytest.raises(StateError, match="holds no tree verify batch"):
        st.accept_path(0, [0])
    assert _looks(st) == before
    st.process(1, [10], x[:1])  # a row since the draft: no longer the round's verify
    with pytest.raises(StateError, match="the first rows after a round's draft \\(1 rows arrived"):
        st.process_tree(1, 11, [-1], x[:1])
    fresh = impl(StagerConfig(D, B, W))
    with pytest.raises(StateError, match="its rows are final: no draft since"):
        fresh.process_tree(0, 0, [-1], x[:1])
    # A round's accept closes it: a tree after it (no new draft) would bring final rows.
    fresh.process(0, np.arange(6), np.repeat(x[:1], 6, axis=0))
    fresh.draft(0, 6)
    fresh.commit(0)
    fresh.process(0, np.arange(6, 6 + B + 1), np.repeat(x[:1], B + 1, axis=0))
    fresh.accept(0, 0)
    before = (fresh.state(0), fresh.stats(0), fresh.snapshot(0))
    with pytest.raises(StateError, match=r"its rows are final: no draft since \(an accept closes a round\)"):
        fresh.process_tree(0, 7, [-1], x[:1])
    assert (fresh.state(0), fresh.stats(0), fresh.snapshot(0)) == before


BAD_PATHS = [
    ("not from the root", [1, 3], "nodes\\[0\\] must be 0"),
    ("skips a node", [0, 3], "nodes\\[1\\] = 3 is not a child of nodes\\[0\\] = 0 \\(its parent is node 1\\)"),
    ("a sibling", [0, 1, 2], "nodes\\[2\\] = 2 is not a child of nodes\\[1\\] = 1"),
    ("out of range", [0, 5], "nodes\\[1\\] = 5 is not a node of the tree \\(0 to 3\\)"),
    ("negative", [0, -1], "nodes\\[1\\] = -1 is not a node"),
    ("empty", [], "a path of the tree holds 1 to 4 nodes, got 0"),
    ("too long", [0, 1, 3, 3, 3], "a path of the tree holds 1 to 4 nodes, got 5"),
]


@pytest.mark.parametrize("impl", [Stager, ReferenceStager], ids=["core", "twin"])
@pytest.mark.parametrize("name,path,words", BAD_PATHS, ids=[p[0] for p in BAD_PATHS])
def test_bad_paths_are_errors_that_change_nothing(impl, name, path, words):
    st = _tree_ready(impl)
    x = massive_rows(np.random.default_rng(0), 4, D)
    st.process_tree(0, 10, [-1, 0, 0, 1], x)
    st.process_tree(1, 10, [-1, 0, 0, 1], x)
    before = _looks(st)
    with pytest.raises(ValueError, match=words):
        st.accept_path(0, path)
    # A batch with one bad path: the good one before it is not applied either.
    with pytest.raises(ValueError, match="accept_path_many: seqs\\[1\\] \\(sequence 0\\): " + words):
        st.accept_path_many([1, 0], [0, 3, 3 + len(path)], [0, 1, 3] + path)
    with pytest.raises(StateError, match="holds a tree verify batch: call accept_path\\(\\) first"):
        st.draft(0, 10)
    with pytest.raises(StateError, match="holds a tree verify batch"):
        st.snapshot(0)
    assert _looks(st) == before
    moves = st.accept_path_many([1, 0], [0, 3, 5], [0, 1, 3, 0, 2])
    assert st.state(0)["end"] == 12 and st.state(1)["end"] == 13 and len(moves) > 0
    assert st.state(0)["tree_nodes"] == 0


@pytest.mark.parametrize("impl", [Stager, ReferenceStager], ids=["core", "twin"])
def test_a_tree_blocks_the_device_step_and_end_drops_it(impl):
    st = _tree_ready(impl, rows="external")
    st.process_tree(0, 10, [-1, 0])
    with pytest.raises(StateError, match="holds a tree verify batch .*accept_path before to_device"):
        st.to_device([1, 0])
    assert not st.on_device(1)
    st.disable(0)  # the drafting switch is any state's
    st.end(0)
    assert st.state(0)["tree_nodes"] == 0 and not st.state(0)["started"]


def test_rows_mode_errors():
    held, ext = _tree_ready(Stager), _tree_ready(Stager, rows="external")
    with pytest.raises(TypeError, match="rows are required"):
        held.process_tree(0, 10, [-1])
    with pytest.raises(TypeError, match=r"call process_tree\(seq, n_past, parents\) without rows"):
        ext.process_tree(0, 10, [-1], np.zeros((1, D), np.float32))


@pytest.mark.parametrize("impl", [Stager, ReferenceStager], ids=["core", "twin"])
@pytest.mark.parametrize("rows", ["held", "external"])
def test_the_batched_tree_calls_are_the_per_sequence_calls(impl, rows):
    """process_tree_many / accept_path_many == process_tree / accept_path of each sequence, in
    order: slots, moves, state and snapshots; a batch with one bad tree changes nothing."""
    rng = np.random.default_rng(11)
    cfg = StagerConfig(D, B, W, max_seqs=3, rows=rows)
    one, many = impl(cfg), impl(cfg)
    ext = rows == "external"
    prompts = [massive_rows(rng, 6 + 5 * s, D) for s in range(3)]
    ends = [len(p) for p in prompts]
    for st in (one, many):
        for s in range(3):
            st.begin(s)
            st.process(s, np.arange(ends[s])) if ext else st.process(s, np.arange(ends[s]), prompts[s])
    order = [2, 0, 1]
    for _ in range(30):
        trees = {s: random_tree(rng, int(rng.integers(1, B + 2))) for s in order}
        paths = {s: random_path(rng, trees[s]) for s in order}
        x = {s: massive_rows(rng, len(trees[s]), D) for s in order}
        for st in (one, many):
            for s in order:
                st.draft(s, ends[s])
                if st.state(s)["open_round"]:
                    st.commit(s)
        cu = np.cumsum([0] + [len(trees[s]) for s in order])
        flat = np.concatenate([trees[s] for s in order])
        rows_flat = None if ext else np.concatenate([x[s] for s in order])
        bad = flat.copy()
        bad[cu[1] + min(1, len(trees[order[1]]) - 1)] = 99 if len(trees[order[1]]) > 1 else 0
        before = [many.state(s) for s in range(3)], [many.stats(s) for s in range(3)]
        with pytest.raises(ValueError, match=r"process_tree_many: seqs\[1\] \(sequence 0\): parents\["):
            many.process_tree_many(order, cu, [ends[s] for s in order], bad, rows_flat)
        assert ([many.state(s) for s in range(3)], [many.stats(s) for s in range(3)]) == before
        got = many.process_tree_many(order, cu, [ends[s] for s in order], flat, rows_flat)
        want = [one.process_tree(s, ends[s], trees[s], None if ext else x[s]) for s in order]
        if ext:
            assert np.array_equal(got, np.concatenate(want))
        pcu = np.cumsum([0] + [len(paths[s]) for s in order])
        m_many = many.accept_path_many(order, pcu, np.concatenate([paths[s] for s in order]))
        m_one = [one.accept_path(s, paths[s]) for s in order]
        assert np.array_equal(m_many, np.concatenate([np.asarray(m) for m in m_one]).reshape(-1, 3))
        for s in order:
            ends[s] += len(paths[s])
            assert many.state(s) == one.state(s) and many.stats(s) == one.stats(s)
            assert many.snapshot(s) == one.snapshot(s)


@pytest.mark.parametrize("rows", ["held", "external"])
def test_the_invariant_checker_follows_trees(rows):
    """dspark_core.testing.InvariantChecker checks tree rounds as it checks linear ones: every plan's
    rows are the rows the server gave at their positions, accepted paths included."""
    from dspark_core.testing import InvariantChecker

    rng = np.random.default_rng(5)
    st = InvariantChecker(Stager(StagerConfig(D, B, W, rows=rows)))
    st.begin(0)
    st.process(0, np.arange(20), massive_rows(rng, 20, D))
    end = 20
    for _ in range(40):
        plan = st.draft(0, end)
        if plan.skip is None:
            st.commit(0)
        parents = random_tree(rng, int(rng.integers(1, B + 2)))
        st.process_tree(0, end, parents, massive_rows(rng, len(parents), D))
        path = random_path(rng, parents)
        st.accept_path(0, path)
        end += len(path)
    assert st.calls > 100


def test_a_ring_owner_writes_trees_and_applies_their_paths():
    """HostRing.write_tree / accept_path(_many): the owner's table after the copies gathers the
    rows a held Stager stages for the same calls; the checks come first and change nothing."""
    from dspark_core import HostRing

    rng = np.random.default_rng(9)
    cfg = StagerConfig(D, B, W, max_seqs=2, storage="bf16")
    held, ring = Stager(cfg), HostRing(Stager(cfg.replace(rows="external")))
    prompt = massive_rows(rng, 16, D)
    for s in range(2):
        held.begin(s)
        held.process(s, np.arange(16), prompt)
        ring.stager.begin(s)
        ring.write(s, np.arange(16), prompt)
    ends = [16, 16]
    for r in range(30):
        trees = [random_tree(rng, int(rng.integers(1, B + 2))) for _ in range(2)]
        paths = [random_path(rng, t) for t in trees]
        x = [massive_rows(rng, len(t), D) for t in trees]
        for s in range(2):
            hp, xp = held.draft(s, ends[s]), ring.stager.draft(s, ends[s])
            if hp.skip is None:
                np.testing.assert_array_equal(ring.to_numpy(ring.gather(xp)), hp.rows)
                held.commit(s)
                ring.stager.commit(s)
            held.process_tree(s, ends[s], trees[s], x[s])
            slots = ring.write_tree(s, ends[s], trees[s], x[s])
            assert len(slots) == len(trees[s])
        if r == 0:  # the ring's checks: the Stager's first, then the rows; nothing changes
            with pytest.raises(StateError, match="holds a tree verify batch"):
                ring.write_tree(0, ends[0], [-1], x[0][:1])
            with pytest.raises(ValueError, match="nodes\\[0\\] must be 0"):
                ring.accept_path(0, [1])
        if r % 2:
            cu = np.cumsum([0, len(paths[0]), len(paths[1])])
            flat = np.concatenate([paths[0], paths[1]])
            held.accept_path_many([0, 1], cu, flat)
            ring.accept_path_many([0, 1], cu, flat)
        else:
            for s in range(2):
                held.accept_path(s, paths[s])
                ring.accept_path(s, paths[s])
        for s in range(2):
            ends[s] += len(paths[s])
            assert held.state(s) == ring.stager.state(s)
    fresh = HostRing(Stager(cfg.replace(rows="external")))
    with pytest.raises(StateError, match="its rows are final"):
        fresh.write_tree(0, 0, [-1], np.zeros((1, D), np.float32))
    bad = massive_rows(rng, 2, D)
    bad[1, 3] = np.inf
    ring.stager.draft(0, ends[0])
    ring.stager.commit(0)
    before = ring.stager.state(0)
    with pytest.raises(ValueError, match="non-finite|overflows"):
        ring.write_tree(0, ends[0], [-1, 0], bad)
    assert ring.stager.state(0) == before
