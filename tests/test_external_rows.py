"""External-row mode: the same state machine, with the rows in the owner's table.

A hypothesis RuleBasedStateMachine drives three stagers with the same calls:
the C++ core in held mode (the oracle of the rows), the C++ core in
external-row mode, and the pure-Python reference in external-row mode. The
test plays the owner of the external rows with a numpy mirror table of
``max_seqs * ring_rows`` rows, driven only by what the external core
returns: it writes each processed row (encoded by ``formats.quantize_rows``,
as a server would) at the slot ``process`` returned, and applies the moves
``fork`` / ``shift`` return, in order. After every call it requires
``mirror[plan.slots]`` to equal the held core's ``plan.encoded_rows`` bit for
bit, the same plans, slots, moves, states and counters from all three, and
that moves never overlap. Windows are small and prefills long, so the ring
wraps around routinely (checked by a deterministic test below).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from conftest import at_once

from dspark_core import Stager, StagerConfig
from dspark_core.stager import snapshot_format
from dspark_core.stager.config import STORAGES
from dspark_core.errors import StateError
from dspark_core.formats import encode_bounds, quantize_rows
from dspark_core.reference import SEMANTIC_STATS, ReferenceStager

#: Filler of slots no row was written to: reading one shows up as a mismatch.
UNWRITTEN = 0xA5
SEQ = hs.integers(-1, 5)


def activations(rng: np.random.Generator, n: int, dim: int, dtype: str = "float32", bos: bool = False) -> np.ndarray:
    """Rows like a transformer's hidden states: N(0, 1) noise, a few massive
    channels (1e3 - 1e5), and a huge-norm first row when ``bos``."""
    x = rng.standard_normal((n, dim)).astype(np.float32)
    massive = rng.choice(dim, size=min(3, dim), replace=False)
    x[:, massive] *= np.float32(1e3) * np.float32(10.0) ** rng.integers(0, 3, size=len(massive)).astype(np.float32)
    if bos and n:
        x[0] *= np.float32(300.0)
    if dtype == "bfloat16":
        return x.astype(ml_dtypes.bfloat16)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type (and the message) is what is compared
        return ("raise", (type(exc), str(exc)))


def encode_like_core(cfg: StagerConfig, rows: np.ndarray) -> np.ndarray:
    """What the owner writes: the rows in storage format, as uint8 (n, row_bytes)."""
    policy = "error" if cfg.nonfinite == "error" else cfg.nonfinite
    enc = quantize_rows(rows, cfg.storage, nonfinite=policy)
    return np.ascontiguousarray(enc).view(np.uint8).reshape(len(rows), cfg.row_bytes)


def held_live_rows(held: Stager, seq: int) -> bytes:
    """The held core's stageable rows [horizon, end), read from its snapshot."""
    cfg = held.config
    return snapshot_format.unpack(held.snapshot(seq), cfg.snapshot_fingerprint(), STORAGES).rows


def apply_moves(table: np.ndarray, moves: np.ndarray) -> None:
    """Apply moves in order, requiring what the contract promises: no range overlaps itself."""
    assert moves.dtype == np.int64 and moves.ndim == 2 and moves.shape[1] == 3
    for src, dst, n in moves.tolist():
        assert n > 0 and 0 <= src and 0 <= dst and src + n <= len(table) and dst + n <= len(table)
        assert src + n <= dst or dst + n <= src, ("overlapping move", src, dst, n)
        table[dst:dst + n] = table[src:src + n].copy()


class ExternalMatchesHeld(RuleBasedStateMachine):
    @initialize(
        dim=hs.sampled_from((32, 64)),
        block=hs.integers(1, 5),
        extra=hs.integers(1, 24),
        seqs=hs.integers(1, 3),
        storage=hs.sampled_from(STORAGES),
        nonfinite=hs.sampled_from(["error", "error", "zero", "clamp_f16", "clamp"]),
        seed=hs.integers(0, 2**16),
    )
    def setup(self, dim, block, extra, seqs, storage, nonfinite, seed):
        cfg = StagerConfig(dim, block, 2 * block + extra, max_seqs=seqs, storage=storage, nonfinite=nonfinite)
        self.cfg = cfg
        self.held = Stager(cfg)
        self.ext = Stager(cfg.replace(rows="external"))
        self.ref = ReferenceStager(cfg.replace(rows="external"))
        assert self.ext.ring_rows == self.ref.ring_rows == cfg.window + 512 + block + 1
        self.mirror = np.full((seqs * self.ext.ring_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
        self.rng = np.random.default_rng(seed)
        self.snaps: list[tuple[bytes, bytes, np.ndarray]] = []

    # -- helpers --------------------------------------------------------
    def pick(self, k):
        return k if k < 0 else k % self.cfg.max_seqs

    def end(self, seq):
        return self.held.state(seq)["end"] if 0 <= seq < self.cfg.max_seqs else 0

    def all3(self, name, *args):
        """The same call on the three stagers: the same outcome; returns the external core's."""
        h = outcome(getattr(self.held, name), *args)
        x = outcome(getattr(self.ext, name), *args)
        r = outcome(getattr(self.ref, name), *args)
        assert h[0] == x[0] == r[0], (name, args, h, x, r)
        if h[0] == "raise":  # the same type; and the two external stagers, the same words
            assert h[1][0] is x[1][0] is r[1][0] and x[1][1] == r[1][1], (name, args, h, x, r)
        return h, x, r

    def check_plan(self, hp, xp, rp):
        for name in ("seq", "skip", "start", "rebase", "clear_cache", "crop_from", "pos_base"):
            assert getattr(hp, name) == getattr(xp, name) == getattr(rp, name), name
        for name in ("positions", "block_positions", "slots"):
            a, b, c = getattr(hp, name), getattr(xp, name), getattr(rp, name)
            assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(b, c), name
        assert xp.slots.dtype == np.int64 and xp.external and not hp.external
        got = self.mirror[xp.slots]
        assert got.tobytes() == hp.encoded_rows.tobytes()
        if len(xp.slots) > 1 and np.any(np.diff(xp.slots) != 1):
            event("plan slots wrap around the ring")
        with pytest.raises(ValueError, match="external-row mode"):
            xp.rows  # noqa: B018

    def feed(self, seq, pos, rows):
        """process on the three; the owner validates first, then writes at the returned slots."""
        limit = encode_bounds(self.cfg.storage, self.cfg.numpy_stage_dtype).limit
        if self.cfg.nonfinite == "error" and len(rows) and not np.all(np.abs(rows.astype(np.float32)) < limit):
            # NaN / Inf, or a value the storage cannot hold: the owner's check rejects the
            # rows before asking for slots (DeviceRing.write does).
            h = outcome(self.held.process, seq, pos, rows)
            assert h[0] == "raise"
            return
        h = outcome(self.held.process, seq, pos, rows)
        x = outcome(self.ext.process, seq, pos)
        r = outcome(self.ref.process, seq, pos)
        assert h[0] == x[0] == r[0], (pos, h, x, r)
        if h[0] == "raise":
            assert h[1][0] is x[1][0] is r[1][0] and x[1][1] == r[1][1], (h, x, r)
            return
        slots = x[1]
        assert slots.dtype == np.int64 and slots.shape == (len(pos),)
        assert np.array_equal(slots, r[1])
        live = slots >= 0
        if live.any():
            enc = encode_like_core(self.cfg, rows)
            self.mirror[slots[live]] = enc[live]
            base = seq * self.ext.ring_rows
            assert np.all((slots[live] >= base) & (slots[live] < base + self.ext.ring_rows))
        # Rows below the horizon come first and get no slot.
        k = int(np.argmax(live)) if live.any() else len(slots)
        assert not live[:k].any() and live[k:].all()

    # -- rules ----------------------------------------------------------
    @rule(seq=SEQ)
    def begin(self, seq):
        self.all3("begin", self.pick(seq))

    @rule(seq=SEQ, n=hs.integers(0, 9), offset=hs.sampled_from([0, 0, 0, 1, -1]),
          dtype=hs.sampled_from(["float32", "float16", "bfloat16"]), nan=hs.booleans())
    def process(self, seq, n, offset, dtype, nan):
        seq = self.pick(seq)
        start = max(0, self.end(seq) + offset)
        rows = activations(self.rng, n, self.cfg.feature_dim, dtype, bos=start == 0)
        if nan and n:
            rows[n // 2, 3] = np.nan
        self.feed(seq, np.arange(start, start + n), rows)

    @rule(seq=hs.integers(0, 2), chunks=hs.lists(hs.integers(1, 700), min_size=1, max_size=3))
    def long_prefill(self, seq, chunks):
        seq = self.pick(seq)
        for n in chunks:
            start = self.end(seq)
            self.feed(seq, np.arange(start, start + n), activations(self.rng, n, self.cfg.feature_dim))

    @rule(seq=SEQ, delta=hs.sampled_from([0, 0, 0, -1, 1]))
    def draft(self, seq, delta):
        seq = self.pick(seq)
        h, x, r = self.all3("draft", seq, max(0, self.end(seq) + delta))
        if h[0] == "ok":
            self.check_plan(h[1], x[1], r[1])

    @rule(seqs=hs.lists(SEQ, max_size=4), delta=hs.sampled_from([0, 0, 1, -1]))
    def draft_many(self, seqs, delta):
        seqs = [self.pick(s) for s in seqs]
        h, x, r = self.all3("draft_many", seqs, [max(0, self.end(s) + delta) for s in seqs])
        if h[0] == "ok":
            for a, b, c in zip(h[1].plans, x[1].plans, r[1].plans):
                self.check_plan(a, b, c)
            assert np.array_equal(h[1].slots, x[1].slots) and np.array_equal(x[1].slots, r[1].slots)
            assert self.mirror[x[1].slots].tobytes() == h[1].encoded_rows.tobytes()

    @rule(seq=hs.integers(0, 5), close=hs.sampled_from(["commit", "commit", "decode"]),
          n_accepted=hs.integers(0, 6), rounds=hs.integers(1, 150))
    def rounds(self, seq, close, n_accepted, rounds):
        """Whole rounds as a server drives them (long runs wrap the ring)."""
        seq = self.pick(seq)
        b = self.cfg.block_size
        for i in range(rounds):
            end = self.end(seq)
            h, x, r = self.all3("draft", seq, end)
            if h[0] == "ok":
                self.check_plan(h[1], x[1], r[1])
                if h[1].skip is None:
                    self.all3("commit" if close == "commit" or i % 2 else "fail", seq)
            self.feed(seq, np.arange(end, end + b + 1), activations(self.rng, b + 1, self.cfg.feature_dim))
            self.all3("accept", seq, min(n_accepted, b))

    @rule(seq=hs.integers(0, 5), sizes=hs.lists(hs.integers(0, 7), min_size=1, max_size=6),
          bad=hs.sampled_from([None, None, None, "parent", "path"]))
    def tree_rounds(self, seq, sizes, bad):
        """Rounds verified as trees: the rows at the slots process_tree hands out, the moves of
        accept_path applied by the owner; bad trees and paths refused alike by the three."""
        seq = self.pick(seq)
        for n in sizes:
            end = self.end(seq)
            h, x, r = self.all3("draft", seq, end)
            if h[0] == "ok" and h[1].skip is None:
                self.all3("commit", seq)
            n = min(n, self.cfg.block_size + 2)
            parents = np.array([-1] + [int(self.rng.integers(0, i)) for i in range(1, n)], np.int64)[:n]
            if bad == "parent" and n > 1:
                parents[-1] = n
            rows = activations(self.rng, n, self.cfg.feature_dim)
            limit = encode_bounds(self.cfg.storage, self.cfg.numpy_stage_dtype).limit
            if self.cfg.nonfinite == "error" and n and not np.all(np.abs(rows.astype(np.float32)) < limit):
                continue  # the owner's own check refuses such rows before asking for slots (feed)
            h = outcome(self.held.process_tree, seq, end, parents, rows)
            x = outcome(self.ext.process_tree, seq, end, parents)
            r = outcome(self.ref.process_tree, seq, end, parents)
            assert h[0] == x[0] == r[0], (h, x, r)
            if h[0] == "raise":
                assert h[1][0] is x[1][0] is r[1][0] and x[1][1] == r[1][1], (h, x, r)
                continue
            assert np.array_equal(x[1], r[1]) and (x[1] >= 0).all()
            self.mirror[x[1]] = encode_like_core(self.cfg, rows)
            node = int(self.rng.integers(0, n))
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(int(parents[path[-1]]))
            path = path[::-1] + ([n] if bad == "path" else [])
            h, x, r = self.all3("accept_path", seq, path)
            if h[0] == "raise":
                h, x, r = self.all3("accept_path", seq, [0])
            # the same copies; numbered alike by the two external stagers (a held restore is no change)
            assert np.array_equal(h[1], x[1]) and np.array_equal(x[1], r[1]) and x[1].serial == r[1].serial
            if len(x[1]):
                event("accept_path moves rows")
            apply_moves(self.mirror, x[1])

    @rule(seq=SEQ)
    def commit(self, seq):
        self.all3("commit", self.pick(seq))

    @rule(seq=SEQ)
    def fail(self, seq):
        self.all3("fail", self.pick(seq), "decode")

    @rule(seq=SEQ, n=hs.integers(-1, 6))
    def accept(self, seq, n):
        self.all3("accept", self.pick(seq), n)

    @rule(seq=SEQ, back=hs.integers(-2, 60))
    def rollback(self, seq, back):
        seq = self.pick(seq)
        self.all3("rollback", seq, self.end(seq) - back)

    @rule(seq=SEQ, n_keep=hs.integers(-1, 60), n_discard=hs.integers(-1, 60), near_end=hs.booleans())
    def shift(self, seq, n_keep, n_discard, near_end):
        seq = self.pick(seq)
        if near_end and n_keep >= 0 and n_discard > 0:
            # Discard a few rows inside the window, keeping live rows on both sides: the tail moves.
            n_discard = 1 + n_discard % 6
            n_keep = max(0, self.end(seq) - 1 - n_keep % 6 - n_discard)
        h, x, r = self.all3("shift", seq, n_keep, n_discard)
        if h[0] == "ok":
            assert np.array_equal(h[1], x[1]) and np.array_equal(x[1], r[1]), (h[1], x[1], r[1])
            if len(x[1]):
                event("shift moves rows")
            apply_moves(self.mirror, x[1])

    @rule(src=SEQ, dst=SEQ)
    def fork(self, src, dst):
        h, x, r = self.all3("fork", self.pick(src), self.pick(dst))
        if h[0] == "ok":
            assert np.array_equal(h[1], x[1]) and np.array_equal(x[1], r[1])
            assert len(x[1]) <= 2
            apply_moves(self.mirror, x[1])

    @rule(seq=SEQ)
    def snapshot(self, seq):
        """External snapshots carry the bookkeeping only; the owner saves the rows at live_slots."""
        seq = self.pick(seq)
        h, x, r = self.all3("snapshot", seq)
        if h[0] == "ok":
            assert x[1] == r[1] and len(x[1]) == snapshot_format.HEADER_BYTES
            self.snaps.append((h[1], x[1], self.mirror[self.ext.live_slots(seq)].copy()))

    @precondition(lambda self: getattr(self, "snaps", None))
    @rule(seq=SEQ, which=hs.integers(0, 100), damage=hs.sampled_from([None, None, "flip", "cut", "grow", "mode"]))
    def restore(self, seq, which, damage):
        seq = self.pick(seq)
        held_snap, ext_snap, saved = self.snaps[which % len(self.snaps)]
        if damage is not None:
            bad = bytearray(ext_snap)
            if damage == "flip":
                bad[which % len(bad)] ^= 1 << (which % 8)
            elif damage == "cut":
                del bad[-(1 + which % 9):]
            elif damage == "grow":
                bad += b"\0" * (1 + which % 5)
            before = [(self.ext.state(s), self.ref.state(s)) for s in range(self.cfg.max_seqs)]
            for st, data in ((self.ext, bytes(bad)), (self.ref, bytes(bad)), (self.held, ext_snap)):
                if damage == "mode" and st is not self.held:
                    data = held_snap  # a held-mode snapshot into an external-row Stager
                got = outcome(st.restore, seq, data)
                assert got[0] == "raise" and got[1][0] in (ValueError, StateError), (damage, got)
            assert before == [(self.ext.state(s), self.ref.state(s)) for s in range(self.cfg.max_seqs)]
            return
        h = outcome(self.held.restore, seq, held_snap)
        x = outcome(self.ext.restore, seq, ext_snap)
        r = outcome(self.ref.restore, seq, ext_snap)
        assert h[0] == x[0] == r[0], (h, x, r)
        if h[0] == "ok":
            assert h[1] is None and np.array_equal(x[1], r[1]) and len(x[1]) == len(saved)
            self.mirror[x[1]] = saved  # the owner puts the saved rows back

    # -- invariants -----------------------------------------------------
    @invariant()
    def same_state(self):
        if not hasattr(self, "cfg"):
            return
        for s in range(self.cfg.max_seqs):
            a, b, c = self.held.state(s), self.ext.state(s), self.ref.state(s)
            assert a == b == c, (s, a, b, c)
            sa, sb, sc = self.held.stats(s), self.ext.stats(s), self.ref.stats(s)
            assert {k: sa[k] for k in SEMANTIC_STATS} == {k: sb[k] for k in SEMANTIC_STATS} == \
                {k: sc[k] for k in SEMANTIC_STATS}
            assert np.array_equal(self.held.accepted(s), self.ext.accepted(s))
            assert np.array_equal(self.held.accepted(s), self.ref.accepted(s))
            # The same ring: the same rows held, trims and peaks; no host bytes in external mode.
            for k in ("rows", "peak_rows", "trims", "trimmed_rows"):
                assert sa[k] == sb[k], (k, sa, sb)
            assert sb["bytes"] == sb["peak_bytes"] == sb["reserved_bytes"] == 0

    @invariant()
    def live_rows_are_in_the_mirror(self):
        """The slots of the stageable rows (what an owner saves with a snapshot) agree and
        hold, in the mirror, the held core's rows [horizon, end)."""
        if not hasattr(self, "cfg"):
            return
        for s in range(self.cfg.max_seqs):
            slots = self.ext.live_slots(s)
            assert np.array_equal(slots, self.held.live_slots(s)) and np.array_equal(slots, self.ref.live_slots(s))
            if not self.held.state(s)["open_round"] and not self.held.state(s)["tree_nodes"]:
                rows = held_live_rows(self.held, s)
                assert self.mirror[slots].tobytes() == rows


ExternalMatchesHeld.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestExternalMatchesHeld = ExternalMatchesHeld.TestCase


# ------------------------------------------------------------ deterministic ---


@pytest.mark.parametrize("storage", STORAGES)
def test_long_decode_wraps_the_ring_and_mirror_matches(storage):
    """A 2,000-round decode on a small window: plans whose slots wrap (two runs) happen, and
    the owner's table read at plan.slots is the held core's rows, bit for bit."""
    cfg = StagerConfig(64, 3, 16, storage=storage, nonfinite="clamp")  # massive channels clamped to the storage
    held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
    mirror = np.full((ext.ring_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
    rng = np.random.default_rng(7)
    pos = np.arange(0, 40)
    rows = activations(rng, 40, 64, bos=True)
    held.process(0, pos, rows)
    mirror[ext.process(0, pos)] = encode_like_core(cfg, rows)
    wrapped = 0
    for _ in range(2000):
        end = held.state(0)["end"]
        hp, xp = held.draft(0, end), ext.draft(0, end)
        assert np.array_equal(hp.slots, xp.slots)
        assert mirror[xp.slots].tobytes() == hp.encoded_rows.tobytes()
        wrapped += bool(len(xp.slots) > 1 and np.any(np.diff(xp.slots) != 1))
        held.commit(0)
        ext.commit(0)
        rows = activations(rng, 4, 64)
        held.process(0, np.arange(end, end + 4), rows)
        slots = ext.process(0, np.arange(end, end + 4))
        mirror[slots] = encode_like_core(cfg, rows)
        held.accept(0, 2)
        ext.accept(0, 2)
    assert wrapped > 0
    assert held.state(0) == ext.state(0)


def test_process_slots_are_the_ring_positions_and_skip_dead_rows():
    cfg = StagerConfig(32, 2, 10, max_seqs=2, rows="external")
    st = Stager(cfg)
    ring = st.ring_rows
    assert ring == 10 + 512 + 2 + 1 == cfg.ring_rows
    # Sequence 1 owns slots [ring, 2 * ring); a fresh ring starts at its first slot.
    np.testing.assert_array_equal(st.process(1, np.arange(0, 4)), ring + np.arange(4))
    # A prompt far longer than the window: the rows no round can stage get -1
    # (the last W stay stageable, so a rollback can still restage K rows).
    st.begin(0)
    slots = st.process(0, np.arange(0, 1000))
    w, k = cfg.window, cfg.w_keep
    assert (slots[: 1000 - w] == -1).all()
    np.testing.assert_array_equal(slots[1000 - w:], np.arange(w))
    plan = st.draft(0, 1000)  # a rebase stages the newest K of them
    np.testing.assert_array_equal(plan.slots, np.arange(w - k, w))
    assert plan.external and plan.n_rows == k


def test_shift_moves_the_tail_down_without_overlap():
    cfg = StagerConfig(32, 2, 64, rows="external")
    st = Stager(cfg)
    st.process(0, np.arange(0, 20))
    # Discard [3, 5): rows 5..19 move down by 2, in non-overlapping pieces of at most 2 rows.
    moves = st.shift(0, 3, 2)
    assert moves.dtype == np.int64 and moves.shape[1] == 3
    assert moves[:, 2].sum() == 15 and (moves[:, 2] <= 2).all()
    np.testing.assert_array_equal(moves[:, 0], np.arange(5, 20, 2))
    np.testing.assert_array_equal(moves[:, 1], np.arange(3, 18, 2))
    # Nothing in the window before n_keep: nothing moves, the slots are renumbered.
    assert st.shift(0, 0, 2).shape == (0, 3)


def test_fork_moves_parent_rows_to_the_child_slots():
    cfg = StagerConfig(32, 2, 64, max_seqs=3, rows="external")
    st = Stager(cfg)
    st.process(2, np.arange(0, 7))
    moves = st.fork(2, 0)
    np.testing.assert_array_equal(moves, [[2 * st.ring_rows, 0, 7]])
    assert st.fork(1, 0).shape == (0, 3)  # an empty parent moves nothing


def test_row_mode_errors_name_the_mode():
    ext = Stager(StagerConfig(32, 2, 10, rows="external"))
    held = Stager(StagerConfig(32, 2, 10))
    rows = np.zeros((1, 32), np.float32)
    with pytest.raises(TypeError, match="external-row mode"):
        ext.process(0, [0], rows)
    with pytest.raises(TypeError, match="rows='held'"):
        held.process(0, [0])
    with pytest.raises(TypeError, match="external-row mode"):
        ext.process_encoded(0, [0], np.zeros((1, 128), np.uint8))
    # Rejected calls change nothing.
    assert ext.state(0)["started"] is False and held.state(0)["started"] is False
    with pytest.raises(Exception, match="rows"):
        StagerConfig(32, 2, 10, rows="device")
    # Held mode: process returns None; plans carry slots there too.
    assert held.process(0, [0, 1, 2], np.ones((3, 32), np.float32)) is None
    np.testing.assert_array_equal(held.draft(0, 3).slots, [0, 1, 2])
    plan = ext.draft(0, 0)
    assert plan.skip == "empty" and plan.slots.shape == (0,)
    with pytest.raises(ValueError, match="external-row mode"):
        plan.encoded_rows  # noqa: B018


def test_external_snapshot_carries_bookkeeping_only_and_restore_gives_the_slots():
    cfg = StagerConfig(64, 3, 16, max_seqs=2)
    held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
    rng = np.random.default_rng(1)
    table = np.full((2 * ext.ring_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
    rows = activations(rng, 700, 64, bos=True)
    held.process(0, np.arange(700), rows)
    slots = ext.process(0, np.arange(700))
    live = slots >= 0
    table[slots[live]] = encode_like_core(cfg, rows)[live]
    snap_h, snap_x = held.snapshot(0), ext.snapshot(0)
    assert len(snap_x) == snapshot_format.HEADER_BYTES < len(snap_h)  # no rows in it
    assert snap_x[14] == snapshot_format.CONTENT_EXTERNAL_ROWS
    saved = table[ext.live_slots(0)].copy()  # the owner saves its rows with the snapshot
    # Cross-mode restores are clear errors that change nothing.
    with pytest.raises(ValueError, match="carries its rows"):
        ext.restore(1, snap_h)
    with pytest.raises(ValueError, match="holds no rows"):
        held.restore(1, snap_x)
    assert ext.state(1)["started"] is False and held.state(1)["started"] is False
    # Restore into the other sequence: the slots where the owner puts the rows back.
    assert held.restore(1, snap_h) is None
    back = ext.restore(1, snap_x)
    assert back.dtype == np.int64 and len(back) == len(saved)
    assert (back >= ext.ring_rows).all() and (back < 2 * ext.ring_rows).all()
    table[back] = saved
    hp, xp = held.draft(1, 700), ext.draft(1, 700)
    assert np.array_equal(hp.slots, xp.slots) and table[xp.slots].tobytes() == hp.encoded_rows.tobytes()


# ------------------------------------------------------ table changes in order ---


def _prepared(storage="f16"):
    """A held and an external Stager fed the same rows, and the owner's mirror table:
    sequence 0 holds 300 rows, 2 holds 200, 4 holds 40, and 5's snapshot (120 rows) is saved."""
    cfg = StagerConfig(32, 4, 400, max_seqs=6, storage=storage)
    held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
    mirror = np.full((cfg.max_seqs * ext.ring_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
    rng = np.random.default_rng(11)
    for seq, n in ((0, 300), (2, 200), (4, 40), (5, 120)):
        rows = activations(rng, n, 32, "float32", bos=True).clip(-6e4, 6e4)
        held.process(seq, np.arange(n), rows)
        mirror[ext.process(seq, np.arange(n))] = encode_like_core(cfg, rows)
    saved = (held.snapshot(5), ext.snapshot(5), mirror[ext.live_slots(5)].copy())
    return cfg, held, ext, mirror, saved


def _apply(mirror, change, saved_rows):
    """An owner's application of one table change: moves, or a restore's slots."""
    if change.ndim == 2:
        apply_moves(mirror, change)
    else:
        mirror[change] = saved_rows


def _threaded_trial(trial):
    """One trial: four threads change the table at once, a fifth drafts another sequence."""
    cfg, held, ext, mirror, (snap_h, snap_x, saved) = _prepared()
    calls = [("shift", (0, 100, 50)), ("fork", (0, 1)), ("restore", (2, snap_x)), ("fork", (2, 3))]
    if trial % 2:
        calls.reverse()  # start order varies too
    plan_rows: list[bytes] = []

    def draft_other():
        plan = ext.draft(4, 40)
        plan_rows.append(mirror[plan.slots].tobytes())  # seq 4 is nobody else's: its rows stand
        ext.commit(4)

    results = at_once([(getattr(ext, name), args) for name, args in calls], draft_other)
    order = sorted(results, key=lambda k: results[k].serial)
    assert [results[k].serial for k in order] == [1, 2, 3, 4]
    assert ext.moves_issued == 4
    for k in order:  # the owner's table, and the held oracle, in serial order
        name, args = calls[k]
        want = getattr(held, name)(*((2, snap_h) if name == "restore" else args))
        _apply(mirror, results[k], saved)
        if name != "restore":
            assert np.array_equal(want, results[k]), (trial, name)
    assert plan_rows == [held.draft(4, 40).encoded_rows.tobytes()]
    held.commit(4)
    for s in range(cfg.max_seqs):
        assert held.state(s) == ext.state(s), (trial, s)
        assert np.array_equal(held.live_slots(s), ext.live_slots(s)), (trial, s)
        assert mirror[ext.live_slots(s)].tobytes() == held_live_rows(held, s), (trial, s)


def test_concurrent_table_changes_are_numbered_in_the_order_they_happened():
    """Threads fork, shift and restore overlapping sequences of one external Stager at once
    (and draft another). The serials the core gives their results are their execution order:
    applied in serial order to a mirror table, and replayed in serial order on a held Stager,
    every sequence's state, slots and rows agree. (Numbered after the call, as the binding
    once did, the serials followed the GIL instead: wrong rows in half the trials.)"""
    for trial in range(150):
        _threaded_trial(trial)


def test_only_the_array_the_stager_returned_is_applicable():
    """A view, slice, reversal or copy of moves carries no identity; an edit is seen."""
    cfg, held, ext, mirror, _ = _prepared()
    moves = ext.shift(0, 100, 50)
    assert len(moves) > 2 and moves.applicable() and moves.serial == 1 and moves.source is ext
    for piece in (moves[:1], moves[::-1], moves.copy(), moves[1:], np.asarray(moves).view(type(moves))):
        assert not piece.applicable() and piece.serial == 0 and piece.source is None
    assert not np.asarray(moves).flags.writeable
    edited = ext.fork(0, 1)
    edited.flags.writeable = True  # the array owns its bytes: numpy lets a caller re-enable writes
    edited[0, 2] -= 1
    assert not edited.applicable()
    slots = ext.restore(3, ext.snapshot(2))
    assert slots.serial == 3 and slots.applicable() and not slots[1:].applicable()
    assert ext.restore(3, ext.snapshot(1)).serial == 4
    # Nothing to apply: no serial (and nothing to refuse).
    assert ext.fork(1, 3).serial == 5 and ext.shift(1, 0, 0).serial == 0


@pytest.mark.parametrize("cls", [Stager, ReferenceStager])
def test_an_external_stager_refuses_to_be_copied(cls):
    """A copy would number the owner's rows differently (its live_slots would not be the
    original's): pickle and deepcopy refuse, naming snapshot + restore."""
    import copy
    import pickle

    st = cls(StagerConfig(32, 4, 400, max_seqs=2, rows="external"))
    st.process(0, np.arange(150))
    for _ in range(30):  # rounds move the live rows away from the ring's first slots
        end = st.state(0)["end"]
        st.draft(0, end)
        st.commit(0)
        st.process(0, np.arange(end, end + 5))
        st.accept(0, 1)
    for how in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied.*snapshot\(seq\) and restore\(seq, data\)"):
            how(st)
    held = cls(StagerConfig(32, 4, 400))
    held.process(0, np.arange(3), np.ones((3, 32), np.float32))
    assert pickle.loads(pickle.dumps(held)).state(0)["end"] == 3  # held mode copies as before
