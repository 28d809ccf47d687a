"""The order of a call's checks with handed-over sequences: the core against the twin.

docs/design.md 2.1: a batch checks every id first (unknown ids), then, sequence by
sequence, every state (a handed-over sequence is a state: ``to_host([q])`` first),
then that no id repeats, then the arguments' values. The twin must refuse each call as
the core does, word for word, and a refused call must change nothing. Every batch call
of the Stager (and of the prefix store) runs here over short batches drawn from: a
handed-over sequence, a ready one, one never started, one in the wrong state for the
call, an unknown id, and repeats of them, with one argument bad at each position (or
none), on both drafter kinds and, where the call exists there, both row modes.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np
import pytest

from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.reference import ReferencePrefixStore, ReferenceStager

B, W, N_SEQS = 2, 9, 6
#: The sequences each Stager starts from: their roles, and the end of each one's rows.
DEVICE, READY, FRESH, OPEN, RESERVED, TREE = range(N_SEQS)
UNKNOWN = 9
END = {DEVICE: 6, READY: 5, FRESH: 0, OPEN: 5, RESERVED: 7, TREE: 7, UNKNOWN: 0}
#: What a batch draws its ids from (a batch of two or three: every order, repeats too).
POOL = (DEVICE, READY, FRESH, OPEN, RESERVED, TREE, UNKNOWN)
KEYS = [b"k0", b"k1"]  # a prefix store's key chain (blocks of 4 positions)


def config(rows: str, kind: str) -> StagerConfig:
    return StagerConfig(feature_dim=16, block_size=B, window=W, max_seqs=N_SEQS, rows=rows, kind=kind)


def ids_of(pos: Any) -> np.ndarray:
    return (np.asarray(pos, np.int64) * 7 + 3).astype(np.int32)


def rows_of(n: int) -> np.ndarray:
    return np.linspace(-1, 1, n * 16, dtype=np.float32).reshape(n, 16)


class Setup:
    """One Stager (the core or the twin) with one sequence in each role."""

    def __init__(self, cls: type, rows: str, kind: str) -> None:
        cfg = config(rows, kind)
        self.st = st = cls(cfg)
        self.held, self.chain = rows == "held", kind == "chain"
        self.store = (ReferencePrefixStore if cls is ReferenceStager else PrefixStore)(cfg, 4, 1 << 20)
        for q in (DEVICE, READY, OPEN, RESERVED, TREE):
            n = END[DEVICE] if q == DEVICE else 5
            st.begin(q)
            self.process(q, np.arange(n))
        st.draft(OPEN, 5)
        st.draft(TREE, 5)
        st.commit(TREE)
        self.tree(TREE, 5, [-1, 0])
        if not self.held:  # a held Stager takes no reservation and no hand-over
            st.reserve(RESERVED, [5, 6], **self.tok([5, 6]))
            st.to_device([DEVICE], **self.table())
        self.tokens = st.new_token_table() if self.chain and not self.held else None

    def tok(self, pos: Any) -> dict[str, Any]:
        return {"tokens": ids_of(pos)} if self.chain else {}

    def table(self) -> dict[str, Any]:
        return {"tokens": self.st.new_token_table()} if self.chain else {}

    def process(self, q: int, pos: np.ndarray) -> None:
        rows = None if not self.held else rows_of(len(pos))
        self.st.process(q, pos, *(() if rows is None else (rows,)), **self.tok(pos))

    def tree(self, q: int, root: int, parents: list[int]) -> None:
        rows = rows_of(len(parents)) if self.held else None
        self.st.process_tree(q, root, parents, rows, **self.tok(np.arange(root, root + len(parents))))

    def fingerprint(self, snapshots: bool = True) -> list[Any]:
        """Whatever a refused call must leave as it was: each host sequence's state, counters,
        accepted histogram, slots and ids (and snapshot when it has one, unless not
        ``snapshots``: the twin's are slow), who is on the device, and the totals."""
        st = self.st
        out: list[Any] = [st.on_device(q) for q in range(N_SEQS)]
        for q in range(N_SEQS):
            if st.on_device(q):
                continue
            s = st.state(q)
            stats = st.stats(q)
            out.append((q, s, {k: stats[k] for k in ("rounds", "commits", "failures", "rows", "skips")},
                        st.accepted(q).tolist(), st.live_slots(q).tolist()))
            if snapshots and not (s["open_round"] or s["reservation_open"] or s["tree_nodes"]):
                out.append(st.snapshot(q))
            if self.chain and s["started"]:
                out.append(st.tokens(q, s["horizon"], s["end"]).tolist())
        t = st.totals()
        out.append(({k: t.stats[k] for k in ("rounds", "commits", "rows")}, t.accepted.tolist(), t.started))
        return out


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """``fn(*args)``'s outcome: ("ok", None), or ("raise", (the exception's type, its message))."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
        return "raise", (type(exc), str(exc))
    return "ok", None


# -- the batch calls: call(setup, ids, bad) ---------------------------------------------------
# ``bad``: the index of the sequence whose argument is bad, None for none, or "convert"
# for an argument that cannot be converted at all (the wrong length).

def _flat(s: Setup, ids: list[int], bad: Any, per: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """cu_seqlens and positions: ``per`` rows for each sequence from its end (one gap at ``bad``)."""
    pos = [np.arange(END[q], END[q] + per) + (k == bad) for k, q in enumerate(ids)]
    cu = np.arange(len(ids) + 1) * per
    if bad == "convert":
        cu = cu[:-1]
    return cu, np.concatenate(pos + [np.zeros(0, np.int64)])


def process_many(s: Setup, ids: list[int], bad: Any) -> None:
    cu, pos = _flat(s, ids, bad)
    rows = (rows_of(len(pos)),) if s.held else ()
    s.st.process_many(ids, cu, pos, *rows, **s.tok(pos))


def check_process_many(s: Setup, ids: list[int], bad: Any) -> None:
    cu, pos = _flat(s, ids, bad)
    s.st.check_process_many(ids, cu, pos, **s.tok(pos))


def reserve_many(s: Setup, ids: list[int], bad: Any) -> None:
    cu, pos = _flat(s, ids, bad)
    s.st.reserve_many(ids, cu, pos, **s.tok(pos))


def _values(ids: list[int], bad: Any, good: Callable[[int], Any], wrong: Any) -> list[Any]:
    vals = [wrong if k == bad else good(q) for k, q in enumerate(ids)]
    return vals + [good(0)] if bad == "convert" else vals


def draft_many(s: Setup, ids: list[int], bad: Any) -> None:
    s.st.draft_many(ids, _values(ids, bad, lambda q: END[q], -1))


def accept_many(s: Setup, ids: list[int], bad: Any) -> None:
    s.st.accept_many(ids, _values(ids, bad, lambda q: 0, B + 7))


def fail_many(s: Setup, ids: list[int], bad: Any) -> None:
    s.st.fail_many(ids, _values(ids, bad, lambda q: "decode", "bogus"))


def process_tree_many(s: Setup, ids: list[int], bad: Any) -> None:
    cu = np.arange(len(ids) + 1) * 2
    if bad == "convert":
        cu = cu[:-1]
    parents = np.concatenate([[0, 0] if k == bad else [-1, 0] for k in range(len(ids))] + [[]]).astype(np.int64)
    roots = [END[q] for q in ids]
    rows = (rows_of(len(parents)),) if s.held else (None,)
    pos = np.concatenate([np.arange(r, r + 2) for r in roots] + [np.zeros(0, np.int64)])
    s.st.process_tree_many(ids, cu, roots, parents, *rows, **s.tok(pos))


def accept_path_many(s: Setup, ids: list[int], bad: Any) -> None:
    cu = np.arange(len(ids) + 1)
    if bad == "convert":
        cu = cu[:-1]
    s.st.accept_path_many(ids, cu, [5 if k == bad else 0 for k in range(len(ids))])


def to_device(s: Setup, ids: list[int], bad: Any) -> None:
    table = {"tokens": s.tokens} if s.chain else {}
    if bad == "convert":
        table = {"tokens": np.zeros(3, np.int64)}
    s.st.to_device(ids, **table)


def to_host(s: Setup, ids: list[int], bad: Any) -> None:
    table = {"tokens": s.tokens} if s.chain else {}
    k = 0 if bad is None or bad == "convert" else bad
    wrong = ("bogus", 7, 2**40, "decode")[k % 4]
    outcomes = None if bad is None else _values(ids, bad, lambda q: None, wrong)
    s.st.to_host(ids, outcomes, **table)


def publish_many(s: Setup, ids: list[int], bad: Any) -> None:
    s.store.publish_many(s.st, ids, [KEYS] * len(ids), [0] * len(ids), _values(ids, bad, lambda q: 4, 99))


def hit_many(s: Setup, ids: list[int], bad: Any) -> None:
    tok = {"tokens": ids_of(np.tile(np.arange(4), len(ids) + (bad == "convert")))} if s.chain else {}
    s.store.hit_many(s.st, ids, [KEYS] * len(ids), _values(ids, bad, lambda q: 4, -3), **tok)


def _plain(name: str) -> Callable[[Setup, list[int], Any], None]:
    def call(s: Setup, ids: list[int], bad: Any) -> None:
        getattr(s.st, name)(ids)
    call.__name__ = name
    return call


#: (call, takes a per-sequence argument); a held Stager gets the external-row calls too
#: (refused, in their turn among the checks).
BATCH_CALLS = [
    (process_many, True), (check_process_many, True), (reserve_many, True), (draft_many, True),
    (accept_many, True), (fail_many, True), (process_tree_many, True), (accept_path_many, True),
    (to_host, True), (publish_many, True), (hit_many, True), (to_device, False),
] + [(_plain(name), False) for name in (
    "commit_many", "confirm_many", "cancel_many", "end_many", "enable_many", "disable_many",
    "open_round_ids", "accepted_many", "changes_of",
)]

#: Both drafter kinds with external rows (the device step's); held rows (no hand-over) once.
MODES = [("external", "block"), ("external", "chain"), ("held", "block")]


def _batches() -> list[list[int]]:
    """Every batch of two, and every order of each batch of three that holds the handed-over
    sequence and an unknown id beside one more (or a repeat of either)."""
    three = {p for r in POOL for p in itertools.permutations((DEVICE, UNKNOWN, r))}
    return [list(b) for b in itertools.product(POOL, repeat=2)] + [list(b) for b in sorted(three)]


def _pair(rows: str, kind: str) -> tuple[Setup, Setup, list[Any]]:
    """The core and the twin, set up alike (checked), and their fingerprint."""
    core, twin = Setup(Stager, rows, kind), Setup(ReferenceStager, rows, kind)
    fp = core.fingerprint()
    assert twin.fingerprint() == fp
    return core, twin, fp


@pytest.mark.parametrize("rows,kind", MODES)
@pytest.mark.parametrize("call,per_seq", BATCH_CALLS, ids=[c[0].__name__ for c in BATCH_CALLS])
def test_batch_calls_check_in_the_cores_order(call, per_seq, rows, kind):
    """Each batch: the core's outcome is the twin's (the same exception, word for word); a
    refused batch leaves both as they were (one that went through: a fresh pair for the next)."""
    core, twin, before = _pair(rows, kind)
    quick = core.fingerprint(False)
    refused = 0
    for ids in _batches():
        for bad in [None, "convert"] + (list(range(len(ids))) if per_seq else []):
            a, b = outcome(call, core, ids, bad), outcome(call, twin, ids, bad)
            where = (call.__name__, rows, kind, ids, bad)
            assert a == b, (where, a, b)
            if a[0] == "raise":
                refused += 1
                assert core.fingerprint() == before, where
                assert twin.fingerprint(False) == quick, where
            else:
                assert core.fingerprint() == twin.fingerprint(), where
                core, twin, before = _pair(rows, kind)
                quick = core.fingerprint(False)
    assert twin.fingerprint() == before  # the twin's snapshots too
    assert refused > 0


def test_the_reported_batches():
    """The issue's example and its orders: sequence 0 on the device, 7 an unknown id."""
    for call in (lambda s: s.enable_many([0, 7]), lambda s: s.accept_many([1, 0], [0, 0]),
                 lambda s: s.accept_many([0, 7], [0, 0]), lambda s: s.commit_many([7, 0])):
        got = []
        for cls in (Stager, ReferenceStager):
            st = cls(StagerConfig(feature_dim=16, block_size=B, window=W, max_seqs=2, rows="external"))
            for q in (0, 1):
                st.begin(q)
                st.process(q, np.arange(5))
            st.to_device([0])
            got.append(outcome(call, st))
        assert got[0] == got[1], got
        assert got[0][0] == "raise"


# -- the per-sequence calls: call(setup, seq, bad), bad None, "value" or "type" --------------------

def _arg(bad: Any, good: Any, value: Any, kind: Any = "x") -> Any:
    return value if bad == "value" else kind if bad == "type" else good


def _positions(q: int, bad: Any) -> Any:
    return _arg(bad, np.arange(END[q], END[q] + 2), np.array([END[q], END[q] + 2]), [1.5, 2.5])


def _process(s: Setup, q: int, bad: Any) -> None:
    pos = _positions(q, bad)
    rows = (rows_of(2),) if s.held else ()
    s.st.process(q, pos, *rows, **s.tok(np.arange(END[q], END[q] + 2)))


def _process_encoded(s: Setup, q: int, bad: Any) -> None:
    data = _arg(bad, np.zeros((2, s.st.config.row_bytes), np.uint8), np.zeros(3, np.uint8), object())
    s.st.process_encoded(q, np.arange(END[q], END[q] + 2), data, **s.tok(np.arange(END[q], END[q] + 2)))


def _tree(name: str) -> Callable[[Setup, int, Any], None]:
    def call(s: Setup, q: int, bad: Any) -> None:
        par = _arg(bad, [-1, 0], [0, 0], ["a", "b"])
        rows = (rows_of(2) if s.held else None,) if name == "process_tree" else ()
        getattr(s.st, name)(q, END[q], par, *rows, **s.tok(np.arange(END[q], END[q] + 2)))
    return call


def _plain_single(name: str) -> Callable[[Setup, int, Any], Any]:
    """A call that takes the sequence alone ("type": an id that is no integer)."""
    return lambda s, q, bad: getattr(s.st, name)(_arg(bad, q, q, "x"))


SINGLE_CALLS: dict[str, Callable[[Setup, int, Any], Any]] = {
    "process": _process,
    "check_process": lambda s, q, bad: s.st.check_process(q, _positions(q, bad), **s.tok(np.arange(END[q], END[q] + 2))),
    "process_encoded": _process_encoded,
    "reserve": lambda s, q, bad: s.st.reserve(q, _positions(q, bad), **s.tok(np.arange(END[q], END[q] + 2))),
    "draft": lambda s, q, bad: s.st.draft(q, _arg(bad, END[q], -1)),
    "fail": lambda s, q, bad: s.st.fail(q, _arg(bad, "decode", "bogus", 5)),
    "accept": lambda s, q, bad: s.st.accept(q, _arg(bad, 0, B + 7)),
    "process_tree": _tree("process_tree"),
    "check_process_tree": _tree("check_process_tree"),
    "accept_path": lambda s, q, bad: s.st.accept_path(q, _arg(bad, [0], [5], ["a"])),
    "rollback": lambda s, q, bad: s.st.rollback(q, _arg(bad, 1, -1)),
    "shift": lambda s, q, bad: s.st.shift(q, 1, _arg(bad, 1, -1)),
    "snapshot_into": lambda s, q, bad: s.st.snapshot_into(q, _arg(bad, bytearray(4096), bytearray(1), object())),
    "restore": lambda s, q, bad: s.st.restore(q, _arg(bad, s.saved, b"junk", 5)),
    "check_restore": lambda s, q, bad: s.st.check_restore(q, _arg(bad, s.saved, b"junk", 5)),
    "tokens": lambda s, q, bad: s.st.tokens(q, 0, _arg(bad, 1, 99)),
    "publish": lambda s, q, bad: s.store.publish(s.st, q, KEYS, 0, _arg(bad, 4, 99)),
    "hit": lambda s, q, bad: s.store.hit(s.st, q, KEYS, _arg(bad, 4, -3),
                                         **({"tokens": ids_of(np.arange(4))} if s.chain else {})),
    **{name: _plain_single(name) for name in (
        "begin", "end", "disable", "enable", "confirm", "cancel", "commit", "snapshot", "snapshot_size", "state",
        "stats", "accepted", "on_device", "live_slots", "buffered_positions", "publishable", "open_round_id",
    )},
}


def _single_pair(rows: str, kind: str) -> tuple[Setup, Setup, list[Any]]:
    core, twin, fp = _pair(rows, kind)
    for x in (core, twin):
        x.saved = core.st.snapshot(READY)  # a snapshot both take (the same bytes)
    return core, twin, fp


def _differential(calls: list[tuple[str, Callable[[Setup], Any]]], rows: str, kind: str) -> int:
    """Each call on the core and the twin: the same outcome, and a refused one changes
    nothing (one that went through: a fresh pair for the next). Returns the refusals."""
    core, twin, before = _single_pair(rows, kind)
    refused = 0
    for where, call in calls:
        a, b = outcome(call, core), outcome(call, twin)
        assert a == b, (where, rows, kind, a, b)
        if a[0] == "raise":
            refused += 1
            assert core.fingerprint() == before, where
            assert twin.fingerprint() == before, where
        else:
            assert core.fingerprint() == twin.fingerprint(), where
            core, twin, before = _single_pair(rows, kind)
    return refused


@pytest.mark.parametrize("rows,kind", MODES)
def test_per_sequence_calls_check_in_the_cores_order(rows, kind):
    """Every per-sequence call on each role (the handed-over sequence, an unknown id, a
    sequence in the wrong state, ...) with a good, a bad or an unconvertible argument;
    ``fork`` on every pair of roles."""
    calls: list[tuple[str, Callable[[Setup], Any]]] = [
        ((name, q, bad), lambda s, f=f, q=q, bad=bad: f(s, q, bad))
        for name, f in SINGLE_CALLS.items() for q in POOL for bad in (None, "value", "type")
    ]
    calls += [(("fork", a, b), lambda s, a=a, b=b: s.st.fork(a, b)) for a in POOL for b in POOL]
    assert _differential(calls, rows, kind) > 0
