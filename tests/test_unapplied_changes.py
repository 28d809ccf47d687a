"""An owner of external rows refuses to write or gather rows a table change it has not applied concerns.

A prefix hit, a publish, a fork, a shift or a restore of an external-row
Stager returns copies for the owner to make. Until it makes them, the
table lacks rows the Stager counts on (a hit's context: a drafter would be
handed the zeros of empty slots) or holds rows a later copy must still
read (a publish's). Before the fix ``HostRing.write`` and ``gather`` went on
and the drafter silently received zero rows. Now every read or write of
such a sequence's rows raises ``ValueError`` naming the call that issued
the change, and changes nothing; applying the change (or calling the
tables' own ``hit`` / ``publish``, which apply theirs) clears it. Other
sequences carry on, so a thread that forks does not stop one that drafts.

Also here: the ``status=`` form of the raw batch calls reports a slot
outside the table instead of raising, and starts each call afresh.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.prefix.host_table import HostPrefixTable
from dspark_core.rows.host_ring import HostRing
from dspark_core.reference import ReferencePrefixStore, ReferenceStager
from dspark_core.rows.ring_owner import STATUS_NONE

D, B, W, BT = 64, 4, 96, 8


def rows_of(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(massive_rows(np.random.default_rng(seed), n, D, peak=3e4), -6e4, 6e4).astype(np.float32)


def keys_of(h: int) -> list[int]:
    return [hash(("k", s)) for s in range(0, h, BT)]


IMPLS = {"core": (Stager, PrefixStore), "reference": (ReferenceStager, ReferencePrefixStore)}


def _setup(impl="core"):
    cfg = StagerConfig(D, B, W, max_seqs=3, rows="external")
    stager, prefix_store = IMPLS[impl]
    st = stager(cfg)
    ring = HostRing(st)
    store = prefix_store(cfg, BT, 1 << 20)
    table = HostPrefixTable(store, ring)
    ring.write(0, np.arange(32), rows_of(32))
    table.publish(ring, 0, keys_of(32), 0, 32)
    return st, ring, store, table


def _frozen(ring, st, seq):
    return ring.table.tobytes(), ring._moves_applied, st.moves_issued, st.state(seq)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_an_unapplied_hit_blocks_write_and_gather_of_its_sequence(impl):
    st, ring, store, table = _setup(impl)
    hit = store.hit(st, 1, keys_of(32), 32)  # the raw call: its moves are the caller's to apply
    assert len(hit.moves) and st.last_change == "start_from_prefix"
    before = _frozen(ring, st, 1)
    with pytest.raises(ValueError, match=r"HostRing\.write: .*PrefixStore\.hit\(\).*apply the missing"):
        ring.write(1, np.arange(32, 33), rows_of(1, 1))
    assert _frozen(ring, st, 1) == before
    batch = st.draft_many([1], [32])
    assert batch.active.all()
    with pytest.raises(ValueError, match=r"HostRing\.gather: .*PrefixStore\.hit\(\)"):
        ring.gather(batch)
    with pytest.raises(ValueError, match=r"HostRing\.gather_slots: .*PrefixStore\.hit\(\)"):
        ring.gather_slots(batch.slots)
    # Sequence 0's rows are not concerned: it goes on.
    ring.write(0, np.arange(32, 33), rows_of(1, 2))
    # Applied, the drafter gets the published rows (not zeros).
    ring.apply(hit.moves, prefix_table=table)
    got = ring.gather(batch)
    assert np.any(got != 0)
    assert got.tobytes() == ring.gather_slots(batch.slots).tobytes()


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_an_unapplied_publish_blocks_its_sequence_and_names_publish(impl):
    st, ring, store, table = _setup(impl)
    ring.write(0, np.arange(32, 40), rows_of(8, 3))
    moves = store.publish(st, 0, keys_of(40)[4:], 32, 40)
    assert len(moves) and st.last_change == "publish_prefix"
    before = _frozen(ring, st, 0)
    with pytest.raises(ValueError, match=r"HostRing\.write_many: .*PrefixStore\.publish\(\)"):
        ring.write_many([0], [0, 1], [40], rows_of(1, 4))
    assert _frozen(ring, st, 0) == before
    ring.apply(moves, prefix_table=table)
    ring.write_many([0], [0, 1], [40], rows_of(1, 4))


def test_an_unapplied_fork_names_fork_and_blocks_both_sequences():
    st, ring, store, table = _setup()
    moves = st.fork(0, 2)
    plan = st.draft(2, 32)
    with pytest.raises(ValueError, match=r"HostRing\.gather: .*Stager\.fork\(\)"):
        ring.gather(plan)
    st.commit(2)
    assert st.last_change == "fork" and st.changes_of([0]) == st.changes_of([2]) == moves.serial
    assert st.changes_of([1]) < moves.serial
    for seq in (0, 2):
        with pytest.raises(ValueError, match=r"Stager\.fork\(\)"):
            ring.write(seq, np.arange(32, 33), rows_of(1))
    ring.apply(moves)
    for seq in (0, 2):
        ring.write(seq, np.arange(32, 33), rows_of(1))


def test_the_docs_recipe_of_a_hit_gathers_the_published_rows():
    """docs/prefix_cache.md's external-row recipe: table.hit applies its own copies."""
    st, ring, store, table = _setup()
    table.hit(ring, 1, keys_of(32), 32)
    plan = st.draft(1, 32)
    got = ring.gather(plan)
    assert np.any(got != 0)
    assert ring.read(st.live_slots(1)).tobytes() == ring.read(st.live_slots(0)).tobytes()


# -- the status= form of the raw batch calls ---------------------------------------------------


@pytest.mark.parametrize("nonfinite", ["error", "zero"])
def test_status_form_reports_a_slot_outside_the_table(nonfinite):
    cfg = StagerConfig(D, B, W, max_seqs=2, rows="external", nonfinite=nonfinite)
    st = Stager(cfg)
    ring = HostRing(st)
    rows = rows_of(3, 5)
    slots = np.array([0, ring.rows + 7, 2])
    status = ring.new_status()
    before = ring.table.copy()
    ring.write_slots(slots, rows, status=status)  # raises nothing
    assert ring.read_status(status).bad_slot_row == 1 and ring.read_status(status).bad_row is None
    if nonfinite == "error":  # a batch with a bad slot changes nothing
        assert ring.table.tobytes() == before.tobytes()
    else:  # the bad row is skipped, the others written
        ring.write_slots(np.array([0, 2]), rows[[0, 2]])
        want = ring.table.copy()
        ring.table[:] = before
        ring.write_slots(slots, rows, status=status)
        assert ring.table.tobytes() == want.tobytes()
    out = ring.gather_slots(slots, status=status)
    assert ring.read_status(status).bad_slot_row == 1
    assert not np.any(out[1]) and out[[0, 2]].tobytes() == ring.gather_slots(np.array([0, 2])).tobytes()
    # The next call reports afresh: a status array reused keeps no earlier report.
    ring.gather_slots(np.array([0, 2]), status=status)
    assert ring.read_status(status).ok
    assert np.array_equal(status, np.full(2, STATUS_NONE, np.uint64))
    # Without status= the same batch raises, naming the row.
    with pytest.raises(ValueError, match=r"slot .* \(row 1\) is outside the table"):
        ring.gather_slots(slots)


def test_changes_of_checks_ids_alone_as_the_reference_does():
    """An unknown id is the same ValueError from the core and the twin; any known sequence answers
    (a handed-over one too: the device step's gathers ask)."""
    messages = []
    for impl in sorted(IMPLS):
        st = IMPLS[impl][0](StagerConfig(D, B, W, max_seqs=3, rows="external"))
        assert st.changes_of([0, 1, 2]) == 0
        with pytest.raises(ValueError) as exc:
            st.changes_of([1, 7])
        messages.append(str(exc.value))
    assert messages[0] == messages[1] and messages[0].startswith("changes_of: seqs[1] (sequence 7)")
