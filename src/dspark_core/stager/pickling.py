"""Pickling and deep-copying a Stager: its config plus every sequence's snapshot.

A server hands a Stager to a worker process with ``pickle`` (or clones one
with ``copy.deepcopy``). What travels is exactly what :meth:`snapshot` /
:meth:`restore` carry, one snapshot per sequence, so the copy is the Stager a
``restore`` of each would give: the same rows and protocol state, every
started sequence restaging on its next round (its drafter cache did not
travel), and the counters of ``stats()`` starting again from zero.

A sequence with an open round cannot be copied: its round belongs to a
drafter call still in flight, and a copy that silently closed it would stage
differently from the original. ``pickle.dumps`` / ``copy.deepcopy`` then
raise :class:`~dspark_core.errors.StateError`; commit or fail the round first.

An external-row Stager cannot be copied either: its rows live in the
owner's table at the slots the Stager handed out, and a restored copy would
number them differently (its ``live_slots`` would not be the original's), so
plans of the copy would read the wrong rows. ``pickle.dumps`` /
``copy.deepcopy`` raise :class:`TypeError` naming the way that works:
``snapshot`` each sequence, ``restore`` it into the new Stager, and copy the
rows from the old ``live_slots`` to the slots ``restore`` returns
(``DeviceRing.snapshot`` / ``DeviceRing.restore`` do both halves).
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import StateError

__all__ = ["reduce_stager", "restore_stager"]


def reduce_stager(stager: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``__reduce__`` of :class:`~dspark_core.Stager` and the reference twin."""
    if stager.config.external_rows:
        raise TypeError(
            "an external-row Stager (rows='external') cannot be pickled or copied: a copy would place the rows "
            "of its owner's table at other slots. Use snapshot(seq) and restore(seq, data) instead: restore "
            "returns the slots where the saved rows go (DeviceRing.snapshot / DeviceRing.restore copy them)"
        )
    snapshots = []
    for seq in range(stager.config.max_seqs):
        if stager.state(seq)["open_round"]:
            raise StateError(
                f"sequence {seq} has an open round: commit() or fail() it before pickling or copying the Stager"
            )
        snapshots.append(stager.snapshot(seq))
    return restore_stager, (type(stager), stager.config, tuple(snapshots))


def restore_stager(cls: type, config: Any, snapshots: tuple[bytes, ...]) -> Any:
    """A new ``cls(config)`` with each sequence restored from its snapshot."""
    stager = cls(config)
    for seq, data in enumerate(snapshots):
        stager.restore(seq, data)
    return stager
