"""What ``fork`` / ``shift`` return: the row copies an owner of external rows applies.

A :class:`SlotMoves` is an ``(n, 3)`` int64 array of ``[src_slot, dst_slot,
count]`` rows: copy table rows ``[src, src + count)`` to ``[dst, dst +
count)``, in the order given. The two ranges of one move never overlap, so a
plain copy is correct (``memcpy``, ``cudaMemcpyAsync``, ``table[d:d+n] =
table[s:s+n]``), and an earlier move never overwrites a row a later one
reads. An empty array means nothing moves.

Each non-empty array also says which Stager issued it (``source``) and its
place in that Stager's sequence of non-empty moves (``serial``, from 1), so
an owner that applies them (``DeviceRing.apply``) can refuse moves of another
Stager, or moves applied out of order, instead of silently corrupting rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SlotMoves", "no_moves"]


class SlotMoves(np.ndarray):
    """``(n, 3)`` int64 moves ``[src_slot, dst_slot, count]`` with ``source`` and ``serial``."""

    source: Any
    serial: int

    @classmethod
    def wrap(cls, moves: np.ndarray, source: Any, serial: int) -> "SlotMoves":
        out = np.asarray(moves, np.int64).reshape(-1, 3).view(cls)
        out.source = source
        out.serial = serial
        out.flags.writeable = False
        return out

    def __array_finalize__(self, obj: Any) -> None:
        self.source = getattr(obj, "source", None)
        self.serial = getattr(obj, "serial", 0)


def no_moves(source: Any) -> SlotMoves:
    """Nothing moves: an empty ``(0, 3)`` array (serial 0: nothing to apply)."""
    return SlotMoves.wrap(np.zeros((0, 3), np.int64), source, 0)
