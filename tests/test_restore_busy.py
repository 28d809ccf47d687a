"""Restore into a slot that still holds rows: one pass, and damaged data leaves it untouched.

A held-mode restore checksums the snapshot's rows while it copies them, so it
must copy them where no stageable row of the slot lives: into the slot's own
ring when its live rows lie outside slots ``[0, n)`` (an emptied ring, or one
whose rows sit further on), else into the Stager's spare ring, swapped in
once the rows check out. Every layout a slot can be in before the restore is
built here (never used, emptied, rows at the front, rows past the front, rows
wrapping the ring's end), and each restore, good or damaged, is compared with
the reference twin: snapshot bytes, live slots and the rows and slots of the
next round. Restores into several busy slots in turn pass the spare ring
around, which the last test drives.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.stager.config import TRIM_CHUNK
from dspark_core.reference import ReferenceStager

from conftest import flipping, massive_rows

D, B, W = 64, 4, 64
RING = W + TRIM_CHUNK + B + 1  # slots per sequence (581)
ROWS_CRC = 88  # offset of the rows' CRC-32C in a v2 header


def config(storage: str) -> StagerConfig:
    return StagerConfig(D, B, W, max_seqs=3, storage=storage)


def feed(st, seq: int, lo: int, hi: int, seed: int, chunk: int = 200) -> None:
    """Process positions [lo, hi) in chunks (rows like real activations)."""
    rows = massive_rows(np.random.default_rng(seed), hi - lo, D)
    for a in range(lo, hi, chunk):
        b = min(hi, a + chunk)
        st.process(seq, np.arange(a, b, dtype=np.int64), rows[a - lo:b - lo])


def round_of(st, seq: int, n_past: int):
    plan = st.draft(seq, n_past)
    out = (plan.skip, plan.pos_base, np.asarray(plan.encoded_rows).copy(), np.asarray(plan.slots).copy())
    if plan.skip is None:
        st.commit(seq)
    return out


def same_state(core: Stager, ref: ReferenceStager, seq: int) -> None:
    assert core.state(seq) == ref.state(seq)
    assert bytes(core.snapshot(seq)) == bytes(ref.snapshot(seq))
    np.testing.assert_array_equal(core.live_slots(seq), ref.live_slots(seq))


def same_next_round(core: Stager, ref: ReferenceStager, seq: int) -> None:
    end = core.state(seq)["end"]
    a, b = round_of(core, seq, end), round_of(ref, seq, end)
    assert a[:2] == b[:2]
    np.testing.assert_array_equal(a[2], b[2])  # the restored rows, byte for byte
    np.testing.assert_array_equal(a[3], b[3])  # ... at the slots the reference's ring model gives


# Layouts of the target slot before the restore: (how to build it, where its live rows end up).
def never_used(st) -> None:
    pass


def emptied(st) -> None:
    feed(st, 1, 0, 50, seed=11)
    st.begin(1)


def rows_at_front(st) -> None:
    feed(st, 1, 0, 40, seed=12)  # slots 0..39: the snapshot's rows land on them


def rows_past_front(st) -> None:
    # 576 rows: the horizon (end - W = 512) is a whole TRIM_CHUNK past the head, so
    # the head moves to slot 512 and the live rows sit in slots 512..575, clear of [0, n).
    feed(st, 1, 0, 576, seed=13, chunk=64)


def rows_straddling(st) -> None:
    # Live rows 576..639 in slots 40..103: the snapshot's 65 rows reach the first 25 of them.
    feed(st, 1, 0, 640, seed=14, chunk=100)


def rows_wrapped(st) -> None:
    feed(st, 1, 0, 600, seed=15, chunk=64)  # live rows 536..599: slots 536..580 then 0..18


LAYOUTS = {f.__name__: f for f in (never_used, emptied, rows_at_front, rows_past_front, rows_straddling,
                                   rows_wrapped)}


def source(st) -> bytes:
    """Sequence 0: a prompt, two rounds with accepts; its snapshot (W + 1 rows, not from position 0)."""
    feed(st, 0, 300, 420, seed=1)
    plan = st.draft(0, 420)
    assert plan.skip is None
    st.commit(0)
    feed(st, 0, 420, 420 + B + 1, seed=2, chunk=B + 1)
    st.accept(0, 2)
    return bytes(st.snapshot(0))


def pair(storage: str, layout: str):
    core, ref = Stager(config(storage)), ReferenceStager(config(storage))
    snaps = [source(core), source(ref)]
    assert snaps[0] == snaps[1]
    for st in (core, ref):
        LAYOUTS[layout](st)
    return core, ref, snaps[0]


def damaged(snap: bytes, where: str) -> bytes:
    b = bytearray(snap)
    if where == "last row":
        b[-3] ^= 0x10  # the rows' CRC catches it only after the whole copy
    elif where == "first row":
        b[96 + 1] ^= 0x01
    else:  # the stored rows' checksum itself
        b[ROWS_CRC] ^= 0x01
        b[92:96] = (0).to_bytes(4, "little")  # ... with the header's own CRC left stale: rejected earlier
    return bytes(b)


@pytest.mark.parametrize("storage", ["f32", "bf16", "q4_0"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_restore_over_each_layout_matches_the_reference(storage, layout):
    core, ref, snap = pair(storage, layout)
    if layout == "rows_past_front":
        assert core.live_slots(1)[0] == 1 * RING + TRIM_CHUNK  # the layout this case is about
    if layout == "rows_straddling":
        assert core.live_slots(1)[0] == 1 * RING + 40
    if layout == "rows_wrapped":
        slots = core.live_slots(1) - RING
        assert slots[0] > slots[-1]  # wraps past the ring's end
    for st in (core, ref):
        assert st.restore(1, snap) is None
    same_state(core, ref, 1)
    same_next_round(core, ref, 1)
    # The slot keeps working: the next rows land where the reference puts them.
    end = core.state(1)["end"]
    for st in (core, ref):
        feed(st, 1, end, end + 3 * W, seed=5, chunk=W // 2)
    same_state(core, ref, 1)
    same_next_round(core, ref, 1)


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("where", ["first row", "last row", "rows crc"])
def test_damaged_restore_leaves_every_layout_untouched(storage, layout, where):
    core, ref, snap = pair(storage, layout)
    before = bytes(core.snapshot(1))
    slots = core.live_slots(1).copy()
    with pytest.raises(ValueError, match="checksum mismatch"):
        core.restore(1, damaged(snap, where))
    assert bytes(core.snapshot(1)) == before
    np.testing.assert_array_equal(core.live_slots(1), slots)
    same_state(core, ref, 1)  # the reference never saw the damaged bytes
    if core.state(1)["started"]:
        same_next_round(core, ref, 1)
    # And a good restore afterwards still lands (through whatever ring the damaged one wrote).
    for st in (core, ref):
        st.restore(1, snap)
    same_state(core, ref, 1)
    same_next_round(core, ref, 1)


def test_restores_into_busy_slots_in_turn_pass_the_spare_ring_around():
    """Each busy restore swaps the spare ring in and leaves the replaced ring as the spare:
    slots 1 and 2 take turns, with damaged snapshots in between, so every ring ends up
    serving another slot. Rows, slots and snapshots stay the reference's throughout."""
    core, ref = Stager(config("f32")), ReferenceStager(config("f32"))
    for st in (core, ref):
        feed(st, 0, 0, 400, seed=21)
        feed(st, 1, 0, 30, seed=22)
        feed(st, 2, 0, 70, seed=23)
    rng = np.random.default_rng(7)
    end0 = 400
    for step in range(12):
        seq = 1 + step % 2
        snap = bytes(core.snapshot(0))
        assert snap == bytes(ref.snapshot(0))
        if step % 3 == 2:
            bad = bytearray(snap)
            bad[96 + int(rng.integers(0, len(snap) - 96))] ^= 0x40
            before = bytes(core.snapshot(seq))
            with pytest.raises(ValueError, match="checksum mismatch"):
                core.restore(seq, bytes(bad))
            assert bytes(core.snapshot(seq)) == before
        for st in (core, ref):
            st.restore(seq, snap)
        for s in (1, 2):
            same_state(core, ref, s)
        same_next_round(core, ref, seq)
        # Keep the restored slot busy (its rows wrap after a few steps), and move the source on.
        end = core.state(seq)["end"]
        for st in (core, ref):
            feed(st, seq, end, end + 37 * (step + 1), seed=100 + step, chunk=64)
            feed(st, 0, end0, end0 + 25, seed=200 + step)
        end0 += 25
    for s in (0, 1, 2):
        same_state(core, ref, s)
        same_next_round(core, ref, s)


@pytest.mark.parametrize("path", ["portable", "best"])
def test_a_buffer_changing_under_restore_never_passes_as_intact(path):
    """Another thread flips a byte of the snapshot's rows back and forth while restore runs
    (the GIL is released): each restore either rejects the data or stores exactly the rows that
    were checksummed, i.e. the original rows (the copy is what gets checksummed, on every
    CRC-32C kernel), and a rejected one leaves the busy slot as it was."""
    from dspark_core import kernels

    cfg = StagerConfig(1024, 4, 64, max_seqs=2)
    st = Stager(cfg)
    rows = massive_rows(np.random.default_rng(3), 60, 1024)
    st.process(0, np.arange(60), rows)  # the source
    st.process(1, np.arange(30), rows[:30])  # a busy slot
    snap = bytes(st.snapshot(0))
    want = snap[96:]
    buf = np.frombuffer(bytearray(snap), np.uint8).copy()
    spot = 96 + len(want) // 2
    before = kernels.active("crc32c")
    if path == "portable":
        kernels.set_path("crc32c", "portable")
    accepted = rejected = 0
    try:
        with flipping(buf, spot):
            for _ in range(300):
                held = bytes(st.snapshot(1))
                try:
                    st.restore(1, buf)
                except ValueError:
                    rejected += 1
                    assert bytes(st.snapshot(1)) == held
                    continue
                accepted += 1
                assert bytes(st.snapshot(1))[96:] == want
    finally:
        kernels.set_path("crc32c", before)
    assert accepted + rejected == 300
