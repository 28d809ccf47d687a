"""Core vs reference: the same random calls, identical results, bit for bit.

A hypothesis RuleBasedStateMachine drives :class:`dspark_core.Stager` (C++)
and :class:`dspark_core.reference.ReferenceStager` (pure Python) with the
same calls, valid and invalid, on several sequences, with small and odd
windows and blocks, every storage format, and prompts far longer than the
window. After every call it requires the same outcome (plan fields, staged
rows byte for byte, or the same exception type), the same protocol state,
the same counters and the same snapshot bytes (which hold every stageable
row), the ring's counters (rows held, peak_rows, trims, trimmed_rows:
the reference keeps the core's lazy-trim bookkeeping) and the core's memory
bound. The ``stream`` rule laps the core's ring so that appends, staged
copies, forks and snapshots straddle its wrap point.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dspark_core import Stager, StagerConfig
from dspark_core.stager.config import STORAGES, TRIM_CHUNK
from dspark_core.reference import SEMANTIC_STATS, ReferenceStager
from dspark_core.stager.totals import COUNTERS
from dspark_core.stager.stage_plan import BATCH_ARRAYS
from conftest import massive_rows

DIMS = (32, 64)
#: Sequence-id draws: mostly valid after pick(); -1 is an unknown id.
SEQ = hs.integers(-1, 5)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
        return ("raise", (type(exc), str(exc)))


def assert_same_plan(a, b):
    assert a.skip == b.skip
    assert a.start == b.start
    assert (a.rebase, a.clear_cache, a.crop_from, a.pos_base) == (b.rebase, b.clear_cache, b.crop_from, b.pos_base)
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(a.block_positions, b.block_positions)
    assert a.slots.dtype == b.slots.dtype == np.int64 and np.array_equal(a.slots, b.slots)
    assert a.positions.dtype == b.positions.dtype == np.int32
    assert a.external == b.external
    if a.tokens is not None or b.tokens is not None:  # a chain drafter's: the staged rows' ids
        assert np.array_equal(a.tokens, b.tokens)
    if a.external:  # external rows: the plan holds slots (compared above), not rows
        return
    assert a.encoded_rows.dtype == np.uint8 and a.encoded_rows.tobytes() == b.encoded_rows.tobytes()
    assert a.rows.dtype == b.rows.dtype and a.rows.shape == b.rows.shape
    assert a.rows.tobytes() == b.rows.tobytes()


class CoreMatchesReference(RuleBasedStateMachine):
    @initialize(
        dim=hs.sampled_from(DIMS),
        block=hs.integers(1, 6),
        extra=hs.integers(1, 30),
        seqs=hs.integers(1, 3),
        storage=hs.sampled_from(STORAGES),
        max_failures=hs.integers(1, 3),
        stage_dtype=hs.sampled_from(["float32", "float16", "bfloat16"]),
        nonfinite=hs.sampled_from(["error", "error", "zero", "clamp_f16", "clamp"]),
        strict=hs.booleans(),
        kind=hs.sampled_from(["block", "block", "chain"]),
        rows=hs.sampled_from(["held", "held", "external"]),
    )
    def setup(self, dim, block, extra, seqs, storage, max_failures, stage_dtype, nonfinite, strict, kind, rows):
        self.cfg = StagerConfig(
            dim, block, 2 * block + extra, max_seqs=seqs, storage=storage, max_failures=max_failures,
            stage_dtype=stage_dtype, nonfinite=nonfinite, strict=strict, kind=kind, rows=rows,
        )
        self.core = Stager(self.cfg)
        self.ref = ReferenceStager(self.cfg)
        self.rng = np.random.default_rng(dim * 1000 + block * 100 + extra)
        self.snaps: list[bytes] = []

    # -- helpers --------------------------------------------------------
    #: The calls that append rows (or check them), and where their positions (process,
    #: reserve) or the tree's parents are: a chain drafter's Stager gets each row's token id
    #: with them (a function of the position, or of the node; now and then a bad one).
    _POSITIONS_AT = {"process": 1, "process_encoded": 1, "process_many": 2, "reserve": 1, "reserve_many": 2,
                     "process_tree": 2, "check_process_tree": 2, "process_tree_many": 3}
    #: Where their rows are (external rows: the core and the twin get None there, and the
    #: owner's slots come back).
    _ROWS_AT = {"process": 2, "process_many": 3, "process_tree": 3, "process_tree_many": 4}

    def token_ids(self, positions):
        ids = (np.abs(np.asarray(positions, np.int64)) * 7 + 3) % 50000
        if len(ids) and self.rng.random() < 0.05:
            ids[int(self.rng.integers(len(ids)))] = -1  # refused: ids are >= 0
        return ids

    def token_kw(self, name, args):
        """The tokens= of a call that takes them: a chain Stager's ids (now and then a negative one,
        none, or one too many), a block Stager's none (now and then some). Returns (kw, bad): bad when
        the ids themselves must be refused."""
        n = len(np.asarray(args[self._POSITIONS_AT[name]]).reshape(-1))
        ids = self.token_ids(args[self._POSITIONS_AT[name]])
        bad = bool((ids < 0).any())
        defect = self.rng.random()
        if self.cfg.kind == "chain":
            if defect < 0.04 and n:
                return {}, True  # a chain drafter's rows need their ids
            if defect < 0.08:
                return {"tokens": np.append(ids, 5)}, True  # one id per row
            return {"tokens": ids}, bad
        if defect < 0.05:
            return {"tokens": ids}, True  # a block drafter's Stager keeps no ids
        return {}, False

    def fingerprint(self):
        """Everything a rejected call must leave as it was: every sequence's state, counters,
        snapshot bytes (which hold the ids) and ids."""
        out = []
        for s in range(self.cfg.max_seqs):
            st = self.core.state(s)
            snap = None if st["open_round"] or st["tree_nodes"] or st["reservation_open"] else self.core.snapshot(s)
            ids = None
            if self.cfg.kind == "chain":
                lo, hi = self.core.buffered_positions(s)
                ids = self.core.tokens(s, lo, hi).tolist()
            out.append((st, self.core.stats(s), snap, ids))
        return out

    def both(self, name, *args):
        kw, bad = {}, False
        if name in self._POSITIONS_AT:
            kw, bad = self.token_kw(name, args)
        if self.cfg.rows == "external" and name in self._ROWS_AT:
            at = self._ROWS_AT[name]
            args = args[:at] + (None,) + args[at + 1:]
        before = self.fingerprint() if bad else None
        a = outcome(lambda *x: getattr(self.core, name)(*x, **kw), *args)
        b = outcome(lambda *x: getattr(self.ref, name)(*x, **kw), *args)
        assert a[0] == b[0], (name, args, kw, a, b)
        if a[0] == "raise":  # the same exception, word for word
            assert a[1][0] is b[1][0] and a[1][1] == b[1][1], (name, args, kw, a, b)
        elif name in ("fork", "shift", "accept_path", "accept_path_many"):  # the moves an owner of external rows would apply
            assert a[1].dtype == b[1].dtype == np.int64 and np.array_equal(a[1], b[1]), (name, args, a, b)
        elif isinstance(a[1], np.ndarray):  # the slots of external rows
            assert a[1].dtype == b[1].dtype and np.array_equal(a[1], b[1]), (name, args, a, b)
        if bad:  # bad ids: refused by both, nothing changed
            assert a[0] == "raise", (name, args, kw, a)
            assert self.fingerprint() == before, (name, args, kw)
        return a, b

    def pick(self, k):
        """Sequence ids: mostly valid (k modulo max_seqs), k < 0 gives an unknown id."""
        return k if k < 0 else k % self.cfg.max_seqs

    def end(self, seq):
        if 0 <= seq < self.cfg.max_seqs:
            return self.ref.state(seq)["end"]
        return 0

    def rows(self, n, dtype, scale, nan_at):
        if scale == "massive":
            x = massive_rows(self.rng, n, self.cfg.feature_dim)
        else:
            x = self.rng.standard_normal((n, self.cfg.feature_dim)).astype(np.float32) * np.float32(scale)
        if nan_at is not None and n:
            r, c = nan_at % n, (nan_at * 7) % self.cfg.feature_dim
            x[r, c] = [np.nan, np.inf, -np.inf][nan_at % 3]
        with np.errstate(over="ignore"):  # large scales overflow float16 to inf on purpose
            if dtype == "bfloat16":
                return x.astype(ml_dtypes.bfloat16)
            return x.astype(dtype)

    # -- rules ----------------------------------------------------------
    @rule(seq=SEQ)
    def begin(self, seq):
        self.both("begin", self.pick(seq))

    @rule(
        seq=SEQ,
        n=hs.integers(0, 12),
        offset=hs.sampled_from([0, 0, 0, 0, 1, -1, "neg", "gap"]),
        dtype=hs.sampled_from(["float32", "float32", "float16", "bfloat16", "float64", "width"]),
        scale=hs.sampled_from([1.0, 1e-4, 1e3, 7e4, "massive", "massive"]),
        nan_at=hs.none() | hs.integers(0, 50),
    )
    def process(self, seq, n, offset, dtype, scale, nan_at):
        seq = self.pick(seq)
        start = self.end(seq)
        if offset == "neg":
            pos = np.arange(-1, n - 1)
        elif offset == "gap":
            pos = np.arange(start, start + n)
            if n > 1:
                pos[-1] += 1
        else:
            pos = np.arange(start + offset, start + offset + n)
            if start + offset < 0:
                pos = np.arange(0, n)
        if dtype == "width":
            rows = self.rows(n, "float32", scale, nan_at)[:, :-1]
        elif dtype == "float64":
            rows = self.rows(n, "float32", scale, nan_at).astype(np.float64)
        else:
            rows = self.rows(n, dtype, scale, nan_at if nan_at is None or nan_at < 12 else None)
        self.both("process", seq, pos, rows)

    @rule(seq=hs.integers(0, 2), chunks=hs.lists(hs.integers(1, 700), min_size=1, max_size=3))
    def long_prefill(self, seq, chunks):
        """Prompts far longer than the window, in chunks (exercises bounded ingest and lazy trim)."""
        seq = self.pick(seq)
        for n in chunks:
            start = self.end(seq)
            self.both("process", seq, np.arange(start, start + n), self.rows(n, "float32", 1.0, None))

    @rule(
        seq=hs.integers(0, 2),
        extra=hs.integers(-40, 80),
        chunk=hs.integers(2, 48),
        draft_every=hs.integers(0, 3),
        n_accepted=hs.integers(0, 6),
    )
    def stream(self, seq, extra, chunk, draft_every, n_accepted):
        """About one lap of the core's ring (W + TRIM_CHUNK + B + 1 slots) in chunks, with rounds between.

        The appends and the staged copies then straddle the ring's wrap
        point, lazy trims fire (the horizon crosses head + TRIM_CHUNK in
        steps of one chunk), and chunks longer than the window take the
        bounded-ingest path; rows, trims and peak_rows are compared exactly.
        """
        seq = self.pick(seq)
        total = max(1, self.cfg.ring_rows + extra)
        done, k = 0, 0
        while done < total:
            n = min(chunk, total - done)
            end = self.end(seq)
            if draft_every and k % draft_every == 0:
                a, b = self.both("draft", seq, end)
                if a[0] == "ok":
                    assert_same_plan(a[1], b[1])
                    if a[1].skip is None:
                        self.both("commit", seq)
            self.both("process", seq, np.arange(end, end + n), self.rows(n, "float32", 1.0, None))
            if draft_every:
                self.both("accept", seq, min(n_accepted, self.cfg.block_size))
            done, k = done + n, k + 1

    @rule(seq=hs.integers(0, 2), n=hs.integers(0, 6), bad=hs.booleans())
    def process_encoded(self, seq, n, bad):
        from dspark_core.reference import formats as rf

        seq = self.pick(seq)
        start = self.end(seq)
        x = self.rows(n, "float32", 1.0, None)
        enc = np.ascontiguousarray(rf.encode(x, self.cfg.storage, "keep")).view(np.uint8).reshape(n, self.cfg.row_bytes)
        if bad and n:
            enc = enc[:, :-1]
        self.both("process_encoded", seq, np.arange(start, start + n), enc)

    @rule(seq=SEQ, delta=hs.sampled_from([0, 0, 0, 0, -1, 1, -3, "zero", "neg"]))
    def draft(self, seq, delta):
        seq = self.pick(seq)
        end = self.end(seq)
        n_past = {"zero": 0, "neg": -1}.get(delta, None)
        if n_past is None:
            n_past = max(0, end + delta)
        a, b = self.both("draft", seq, n_past)
        if a[0] == "ok":
            assert_same_plan(a[1], b[1])
            plan = a[1]
            if plan.skip is None:
                w = self.cfg.window
                assert plan.block_positions[-1] < w
                assert plan.n_rows == 0 or plan.positions[0] >= 0
                if plan.n_rows:
                    assert plan.positions[-1] + 1 == plan.block_positions[0]

    @rule(seqs=hs.lists(SEQ, max_size=4), delta=hs.sampled_from([0, 0, 1, -1]))
    def draft_many(self, seqs, delta):
        seqs = [self.pick(x) for x in seqs]
        pasts = [max(0, self.end(s) + delta) for s in seqs]
        a, b = self.both("draft_many", seqs, pasts)
        if a[0] == "ok":
            for name in BATCH_ARRAYS:
                x, y = getattr(a[1], name), getattr(b[1], name)
                assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
            for pa, pb in zip(a[1].plans, b[1].plans):
                assert_same_plan(pa, pb)
            np.testing.assert_array_equal(a[1].row_seq, b[1].row_seq)
            np.testing.assert_array_equal(a[1].positions, b[1].positions)
            if not self.cfg.external_rows:
                assert a[1].rows.tobytes() == b[1].rows.tobytes()

    @rule(
        seq=hs.integers(0, 5),
        close=hs.sampled_from(["commit", "commit", "commit", "decode", "crop"]),
        n_verify=hs.integers(0, 3),
        n_accepted=hs.integers(0, 8),
        rounds=hs.integers(1, 8),
    )
    def rounds(self, seq, close, n_verify, n_accepted, rounds):
        """Whole rounds as a server drives them: draft, close, verify B + 1 rows, accept."""
        seq = self.pick(seq)
        b = self.cfg.block_size
        for r in range(rounds):
            end = self.end(seq)
            a, _ = self.both("draft", seq, end)
            if a[0] == "ok":
                assert_same_plan(a[1], _[1])
                if a[1].skip is None:
                    self.both("commit", seq) if close == "commit" or r % 2 else self.both("fail", seq, close)
            n = b + 1 if n_verify == 0 else min(n_verify, b + 1)
            self.both("process", seq, np.arange(end, end + n), self.rows(n, "float32", 1.0, None))
            self.both("accept", seq, min(n_accepted, b))

    # -- tree verification (docs/design.md 2.11) -------------------------
    def tree(self, n, bad):
        """Random parents of an n-node tree (parents[i] < i), or a bad one."""
        par = ([-1] + [int(self.rng.integers(0, i)) for i in range(1, n)])[:n]
        if bad == "cycle" and n > 1:
            par[-1] = n - 1  # its own parent
        elif bad == "later" and n > 2:
            par[1] = 2  # a parent after its child
        elif bad == "root" and n:
            par[0] = 0
        elif bad == "range" and n > 1:
            par[-1] = -5
        return par

    def path(self, par, depth, bad):
        """A root-to-node path of the tree (at most depth + 1 nodes), or a bad one."""
        node = int(self.rng.integers(0, len(par)))
        path = [node]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        path = path[::-1][: depth + 1]
        if bad == "skip" and len(path) > 2:
            del path[1]
        elif bad == "start":
            path[0] = len(par) - 1
        elif bad == "range":
            path.append(len(par))
        elif bad == "empty":
            path = []
        return path

    @rule(
        seq=SEQ,
        n=hs.integers(0, 8),
        tree_bad=hs.sampled_from([None, None, None, None, "cycle", "later", "root", "range", "n_past"]),
        path_bad=hs.sampled_from([None, None, None, None, "skip", "start", "range", "empty"]),
        depth=hs.integers(0, 8),
        scale=hs.sampled_from([1.0, "massive", 7e4]),
        rounds=hs.integers(1, 4),
    )
    def tree_rounds(self, seq, n, tree_bad, path_bad, depth, scale, rounds):
        """Rounds verified as trees: draft, commit, process_tree, accept_path (bad trees and paths too)."""
        seq = self.pick(seq)
        if 0 <= seq < self.cfg.max_seqs and not self.ref.state(seq)["started"]:  # a prompt to draft from
            n_prompt = 2 * self.cfg.block_size + 3
            self.both("process", seq, np.arange(n_prompt), self.rows(n_prompt, "float32", 1.0, None))
        for _ in range(rounds):
            end = self.end(seq)
            a, b = self.both("draft", seq, end)
            if a[0] == "ok" and a[1].skip is None:
                self.both("commit", seq)
            nodes = min(n, self.cfg.block_size + 2)
            par = self.tree(nodes, tree_bad)
            self.both("process_tree", seq, end + (tree_bad == "n_past"), np.array(par, np.int64),
                      self.rows(nodes, "float32", scale, None))
            if 0 <= seq and self.ref.state(seq)["tree_nodes"]:
                self.both("accept_path", seq, self.path(self.ref._seqs[seq].tree, depth, path_bad))
                if self.ref.state(seq)["tree_nodes"]:
                    self.both("accept_path", seq, [0])

    @rule(seqs=hs.lists(SEQ, max_size=3), sizes=hs.lists(hs.integers(0, 7), min_size=3, max_size=3),
          bad=hs.sampled_from([None, None, "later", "n_past", "cu"]), draft=hs.booleans())
    def process_tree_many(self, seqs, sizes, bad, draft):
        """Trees for several sequences in one call (after a round's draft when ``draft``)."""
        ids = [self.pick(s) for s in seqs]
        if draft:
            for s in dict.fromkeys(i for i in ids if i >= 0):
                a, _ = self.both("draft", s, self.end(s))
                if a[0] == "ok" and a[1].skip is None:
                    self.both("commit", s)
        trees = [self.tree(min(n, self.cfg.block_size + 1), bad if k == len(ids) - 1 else None)
                 for k, n in zip(range(len(ids)), sizes)]
        cu = np.cumsum([0] + [len(t) for t in trees])
        if bad == "cu" and len(ids):
            cu[-1] += 1
        roots = [self.end(s) + (bad == "n_past" and k == 0) for k, s in enumerate(ids)]
        flat = np.array([p for t in trees for p in t], np.int64)
        self.both("process_tree_many", np.array(ids, np.int64), cu, roots, flat,
                  self.rows(len(flat), "float32", 1.0, None))

    @rule(seq=SEQ, n=hs.integers(0, 4))
    def process_tree_anytime(self, seq, n):
        """A tree verify batch whenever: after rows, before any draft, over an open round or tree."""
        seq = self.pick(seq)
        self.both("process_tree", seq, self.end(seq), self.tree(n, None), self.rows(n, "float32", 1.0, None))

    @rule(seq=SEQ, n=hs.integers(0, 4), tree_bad=hs.sampled_from([None, None, "later", "n_past"]))
    def check_process_tree(self, seq, n, tree_bad):
        """process_tree's checks alone (after a round's draft): the same verdict, nothing changed."""
        seq = self.pick(seq)
        if 0 <= seq < self.cfg.max_seqs and self.ref.state(seq)["started"]:
            a, _ = self.both("draft", seq, self.end(seq))
            if a[0] == "ok" and a[1].skip is None:
                self.both("commit", seq)
        before = self.fingerprint()
        self.both("check_process_tree", seq, self.end(seq) + (tree_bad == "n_past"),
                  np.array(self.tree(n, tree_bad), np.int64))
        assert self.fingerprint() == before

    # -- slots before the rows (external rows; held: refused) ------------
    @rule(seq=SEQ, n=hs.integers(0, 6), offset=hs.sampled_from([0, 0, 0, 1, -1]),
          close=hs.sampled_from(["confirm", "cancel", "confirm_many", "cancel_many", None]))
    def reserve(self, seq, n, offset, close):
        """reserve the next rows' slots (with their ids), then confirm or cancel (or leave it open)."""
        seq = self.pick(seq)
        start = max(0, self.end(seq) + offset)
        self.both("reserve", seq, np.arange(start, start + n))
        if close is not None:
            self.both(close, [seq] if close.endswith("_many") else seq)

    @rule(seqs=hs.lists(SEQ, max_size=3), counts=hs.lists(hs.integers(0, 3), min_size=3, max_size=3),
          close=hs.sampled_from(["confirm_many", "cancel_many", None]))
    def reserve_many(self, seqs, counts, close):
        ids = [self.pick(s) for s in seqs]
        pos = [np.arange(self.end(s), self.end(s) + c) for s, c in zip(ids, counts)]
        cu = np.cumsum([0] + [len(p) for p in pos])
        self.both("reserve_many", np.array(ids, np.int64), cu, np.concatenate(pos + [np.zeros(0, np.int64)]))
        if close is not None:
            self.both(close, ids)

    @rule(seq=SEQ, nodes=hs.lists(hs.integers(-1, 6), max_size=5))
    def accept_path_anytime(self, seq, nodes):
        self.both("accept_path", self.pick(seq), nodes)

    @rule(seqs=hs.lists(SEQ, max_size=3), depth=hs.integers(0, 6), path_bad=hs.sampled_from([None, None, "skip"]))
    def accept_path_many(self, seqs, depth, path_bad):
        ids = [self.pick(s) for s in seqs]
        paths = []
        for s in ids:
            tree = self.ref._seqs[s].tree if 0 <= s < self.cfg.max_seqs else None
            paths.append(self.path(tree, depth, path_bad) if tree else [0])
        cu = np.cumsum([0] + [len(p) for p in paths])
        flat = np.array([v for p in paths for v in p], np.int64)
        self.both("accept_path_many", np.array(ids, np.int64), cu, flat)

    @rule(seq=SEQ)
    def commit(self, seq):
        self.both("commit", self.pick(seq))

    @rule(seq=SEQ, stage=hs.sampled_from(["decode", "crop", "bogus"]))
    def fail(self, seq, stage):
        self.both("fail", self.pick(seq), stage)

    @rule(seq=SEQ, n=hs.integers(-1, 8))
    def accept(self, seq, n):
        self.both("accept", self.pick(seq), n)

    @rule(seq=SEQ, back=hs.integers(-2, 40))
    def rollback(self, seq, back):
        seq = self.pick(seq)
        self.both("rollback", seq, self.end(seq) - back)

    @rule(seq=SEQ, n_keep=hs.integers(-1, 40), n_discard=hs.integers(-1, 40))
    def shift(self, seq, n_keep, n_discard):
        self.both("shift", self.pick(seq), n_keep, n_discard)

    @rule(seq=SEQ, on=hs.booleans())
    def switch_drafting(self, seq, on):
        """disable / enable: a skip of its own while rows keep flowing, drafts at once when back on."""
        self.both("enable" if on else "disable", self.pick(seq))

    @rule(seqs=hs.lists(SEQ, max_size=3), on=hs.booleans())
    def switch_drafting_many(self, seqs, on):
        self.both("enable_many" if on else "disable_many", [self.pick(q) for q in seqs])

    @rule(src=SEQ, dst=SEQ)
    def fork(self, src, dst):
        self.both("fork", self.pick(src), self.pick(dst))

    @rule(seq=SEQ)
    def snapshot(self, seq):
        a, b = self.both("snapshot", self.pick(seq))
        if a[0] == "ok":
            assert a[1] == b[1]
            self.snaps.append(a[1])

    @rule(seq=SEQ, pad=hs.sampled_from([0, 0, 7, -1]), kind=hs.sampled_from(["bytearray", "ndarray"]))
    def snapshot_into(self, seq, pad, kind):
        """Into a caller's buffer: the same bytes as snapshot(), nothing past them; too small changes nothing."""
        s = self.pick(seq)
        sizes = self.both("snapshot_size", s)
        if sizes[0][0] != "ok":
            return
        assert sizes[0][1] == sizes[1][1]
        n = max(0, sizes[0][1] + pad)
        bufs = [bytearray(b"\x5a" * n) if kind == "bytearray" else np.full(n, 0x5A, np.uint8) for _ in range(2)]
        a, b = outcome(self.core.snapshot_into, s, bufs[0]), outcome(self.ref.snapshot_into, s, bufs[1])
        assert a[0] == b[0] and (a[0] != "raise" or a[1] == b[1]), (a, b)
        assert bytes(bufs[0]) == bytes(bufs[1])
        if a[0] == "ok":
            assert a[1] == b[1] == sizes[0][1]
            assert bytes(bufs[0])[: a[1]] == self.core.snapshot(s)
            assert bytes(bufs[0])[a[1]:] == b"\x5a" * (n - a[1])
        else:
            assert bytes(bufs[0]) == b"\x5a" * n

    @precondition(lambda self: self.snaps)
    @rule(seq=SEQ, which=hs.integers(0, 100), damage=hs.sampled_from([None, None, "flip", "cut", "grow"]))
    def restore(self, seq, which, damage):
        data = bytearray(self.snaps[which % len(self.snaps)])
        if damage == "flip":
            data[which % len(data)] ^= 1 << (which % 8)
        elif damage == "cut":
            del data[-(1 + which % 9):]
        elif damage == "grow":
            data += b"\0" * (1 + which % 5)
        self.both("restore", self.pick(seq), bytes(data))

    # -- the device step's hand-overs (external rows; held: refused) ------
    def tables(self):
        """The slot token tables of a chain drafter's Stager (the core's, the twin's), kept across
        hand-overs: to_host reads back the ids to_device wrote."""
        if self.cfg.kind != "chain":
            return {}, {}
        if not hasattr(self, "core_table"):
            self.core_table, self.ref_table = self.core.new_token_table(), self.ref.new_token_table()
        return {"tokens": self.core_table}, {"tokens": self.ref_table}

    def hand(self, name, seqs):
        """to_device / to_host of ``seqs`` on both: the same outcome, the same tables."""
        kc, kr = self.tables()
        a = outcome(lambda x: getattr(self.core, name)(x, **kc), seqs)
        b = outcome(lambda x: getattr(self.ref, name)(x, **kr), seqs)
        assert a[0] == b[0] and (a[0] == "ok" or a[1] == b[1]), (name, seqs, a, b)
        if kc:
            assert np.array_equal(kc["tokens"], kr["tokens"]), (name, seqs)
        return a[0] == "ok"

    def back_to_host(self):
        """Every handed-over sequence back (the invariants read every sequence on the host)."""
        held = [q for q in range(self.cfg.max_seqs) if self.core.on_device(q)]
        assert held == [q for q in range(self.cfg.max_seqs) if self.ref.on_device(q)]
        if held:
            assert self.hand("to_host", held), held

    #: Batch calls a handed-over sequence meets (beside others) while it is on the device.
    _BESIDE = ("accept_many", "enable_many", "disable_many", "commit_many", "fail_many", "draft_many",
               "confirm_many", "cancel_many", "end_many", "open_round_ids", "accepted_many", "changes_of")

    @rule(seqs=hs.lists(SEQ, max_size=3), others=hs.lists(SEQ, max_size=3), call=hs.sampled_from(_BESIDE),
          order=hs.randoms(use_true_random=False))
    def hand_over_in_batches(self, seqs, others, call, order):
        """to_device, then a batch naming the handed-over sequences among others (unknown ids,
        repeats), refused in the core's order of checks (or, end_many, ending them), then to_host."""
        ids = [self.pick(x) for x in seqs]
        for q in dict.fromkeys(q for q in ids if q >= 0 and not self.ref.state(q)["started"]):
            self.both("process", q, np.arange(4), self.rows(4, "float32", 1.0, None))  # rows to hand over
        self.hand("to_device", ids)
        batch = ids + [self.pick(x) for x in others]
        order.shuffle(batch)
        extra = {"accept_many": ([0] * len(batch),), "fail_many": (["decode"] * len(batch),),
                 "draft_many": ([self.end(q) if q < 0 or not self.core.on_device(q) else 0 for q in batch],)}
        self.both(call, batch, *extra.get(call, ()))
        self.back_to_host()

    @rule(seq=hs.integers(0, 2), extra=hs.integers(0, 30), hand=hs.booleans(),
          close=hs.sampled_from(["cancel", "cancel", "confirm", "cancel_many"]))
    def long_reservation(self, seq, extra, hand, close):
        """A reservation of more than the window's rows (a long prefill chunk's), handed over
        and back now and then, then cancelled (the sequence as before it, ids and all) or
        confirmed."""
        seq = self.pick(seq)
        end = self.end(seq)
        self.both("reserve", seq, np.arange(end, end + self.cfg.window + 1 + extra))
        if hand:
            self.hand("to_device", [seq])
            self.back_to_host()
        self.both(close, [seq] if close.endswith("_many") else seq)

    @rule(seq=hs.integers(0, 2), p0=hs.sampled_from([0, 100]), n=hs.integers(1, 4))
    def hand_over_after_reserve(self, seq, p0, n):
        """begin, reserve, to_device, to_host, cancel: the hand-over round trip of a sequence
        whose only rows are reserved; cancel puts back the sequence begin left."""
        seq = self.pick(seq)
        self.both("begin", seq)
        self.both("reserve", seq, np.arange(p0, p0 + n))
        self.hand("to_device", [seq])
        self.back_to_host()
        self.both("cancel", seq)

    # -- invariants -----------------------------------------------------
    @invariant()
    def same_state(self):
        if not hasattr(self, "cfg"):
            return
        bound = self.cfg.window + TRIM_CHUNK + self.cfg.block_size + 1
        for s in range(self.cfg.max_seqs):
            a, b = self.core.state(s), self.ref.state(s)
            assert a == b, (s, a, b)
            sa, sb = self.core.stats(s), self.ref.stats(s)
            assert {k: sa[k] for k in SEMANTIC_STATS} == {k: sb[k] for k in SEMANTIC_STATS}
            assert sa["peak_rows"] <= bound
            assert np.array_equal(self.core.accepted(s), self.ref.accepted(s)), s
            if not a["open_round"] and not a["tree_nodes"] and not a["reservation_open"]:
                assert self.core.snapshot(s) == self.ref.snapshot(s)
            if self.cfg.kind == "chain":  # the ids beside the rows: a snapshot holds them too, this reads them
                lo, hi = self.core.buffered_positions(s)
                assert np.array_equal(self.core.tokens(s, lo, hi), self.ref.tokens(s, lo, hi)), s
        # The Stager's metrics: the same, and no counter ever goes back.
        ta, tb = self.core.totals(), self.ref.totals()
        assert {k: ta.stats[k] for k in SEMANTIC_STATS} == tb.stats, (ta, tb)
        assert np.array_equal(ta.accepted, tb.accepted) and ta.started == tb.started
        last = getattr(self, "last_totals", None)
        if last is not None:
            for k in COUNTERS:
                assert ta.stats[k] >= last.stats[k], k
            assert (ta.accepted >= last.accepted).all()
        self.last_totals = ta


TestCoreMatchesReference = CoreMatchesReference.TestCase
