"""What ``fork`` / ``shift`` / ``restore`` return: the table changes an owner of external rows applies.

A :class:`SlotMoves` is an ``(n, 3)`` int64 array of ``[src_slot, dst_slot,
count]`` rows: copy table rows ``[src, src + count)`` to ``[dst, dst +
count)``, in the order given. The two ranges of one move never overlap, so a
plain copy is correct (``memcpy``, ``cudaMemcpyAsync``, ``table[d:d+n] =
table[s:s+n]``), and an earlier move never overwrites a row a later one
reads. An empty array means nothing moves. A :class:`RestoredSlots` (what
``restore`` returns in external-row mode) is the int64 slots where the owner
puts a snapshot's rows back.

Each non-empty one also carries its identity: which Stager issued it
(``source``) and its place in that Stager's one sequence of table changes
(``serial``, from 1), numbered by the C++ core under the lock of the operation
that made it, so that serial order is the order the changes happened in, even
when several threads fork, shift and restore at once. An owner applies them
in serial order (``DeviceRing.apply`` / ``restore`` refuse anything else).
Only the array the Stager returned carries that identity: a view, slice,
reversal or copy of it (``m[:1]``, ``m[::-1]``, ``m.copy()``) has
``serial == 0`` and ``source is None``, and :meth:`applicable` is False for
those and for an array edited in place after it was issued.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SlotMoves", "RestoredSlots", "no_moves"]


class _Issued(np.ndarray):
    """An int64 array a Stager issued, with its identity (``source``, ``serial``)."""

    source: Any
    serial: int
    _issued_bytes: bytes | None

    @classmethod
    def _issue(cls, values: np.ndarray, source: Any, serial: int) -> Any:
        out = values.view(cls)
        out.source = source
        out.serial = serial
        out._issued_bytes = out.tobytes()
        out.flags.writeable = False
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # Views, slices and copies are new arrays: they carry no identity.
        self.source = None
        self.serial = 0
        self._issued_bytes = None

    def applicable(self) -> bool:
        """Whether this is the array a Stager issued, unchanged (a view, slice,
        copy or edit of it is not: it carries no serial, or other bytes)."""
        return self.serial > 0 and self._issued_bytes is not None and self.tobytes() == self._issued_bytes


class SlotMoves(_Issued):
    """``(n, 3)`` int64 moves ``[src_slot, dst_slot, count]`` with ``source`` and ``serial``."""

    @classmethod
    def wrap(cls, moves: np.ndarray, source: Any, serial: int) -> "SlotMoves":
        out: SlotMoves = cls._issue(np.ascontiguousarray(moves, np.int64).reshape(-1, 3), source, serial)
        return out


class RestoredSlots(_Issued):
    """``(n,)`` int64 slots where a snapshot's rows go back, with ``source`` and ``serial``."""

    @classmethod
    def wrap(cls, slots: np.ndarray, source: Any, serial: int) -> "RestoredSlots":
        out: RestoredSlots = cls._issue(np.ascontiguousarray(slots, np.int64).reshape(-1), source, serial)
        return out


def no_moves(source: Any) -> SlotMoves:
    """Nothing moves: an empty ``(0, 3)`` array (serial 0: nothing to apply)."""
    return SlotMoves.wrap(np.zeros((0, 3), np.int64), source, 0)
