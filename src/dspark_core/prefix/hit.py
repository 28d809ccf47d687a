"""What the prefix store returns: :class:`PrefixHit` and :class:`PrefixMoves`.

Both the C++ store's binding and the reference twin return these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._ext._row_format import PREFIX_HIT_FIELDS
from ..rows.slot_moves import SlotMoves

__all__ = ["PrefixHit", "PrefixHits", "PrefixMoves", "no_prefix_moves", "PUBLISH", "HIT"]

#: ``PrefixMoves.direction`` of a publish: the Stager's ring table (src) to the store's table (dst).
PUBLISH = "publish"
#: ``PrefixMoves.direction`` of a hit: the store's table (src) to the Stager's ring table (dst).
HIT = "hit"


class PrefixMoves(SlotMoves):
    """``(n, 3)`` int64 copies ``[src_slot, dst_slot, count]`` between two tables.

    Like the moves ``fork`` / ``shift`` return (``source``: the Stager that
    issued them, ``serial``: their place among its non-empty moves), but the
    source and destination slots index different tables: the Stager's ring
    table and the ``store``'s table (external-row mode). ``direction`` is
    :data:`PUBLISH` (ring -> store) or :data:`HIT` (store -> ring). Apply them
    in order before the next call on the Stager or the store
    (``DeviceRing.apply`` does, with a ``cuda.PrefixTable``; ``HostRing.apply``
    with a ``HostPrefixTable``).
    """

    direction: str
    store: Any

    @classmethod
    def wrap_prefix(cls, moves: np.ndarray, source: Any, serial: int, direction: str, store: Any) -> "PrefixMoves":
        out = cls.wrap(moves, source, serial)
        assert isinstance(out, PrefixMoves)
        out.direction = direction
        out.store = store
        return out

    def __array_finalize__(self, obj: Any) -> None:
        super().__array_finalize__(obj)
        self.direction = getattr(obj, "direction", "")
        self.store = getattr(obj, "store", None)


def no_prefix_moves(source: Any, direction: str, store: Any) -> PrefixMoves:
    """Nothing to copy (held mode, or nothing moved): empty, serial 0."""
    return PrefixMoves.wrap_prefix(np.zeros((0, 3), np.int64), source, 0, direction, store)


@dataclass(frozen=True)
class PrefixHit:
    """What a prefix-cache hit of ``n_tokens`` positions found (``PrefixStore.hit`` / ``lookup``).

    Attributes:
        n_tokens: positions the server's prefix cache holds (``h``).
        need_first: the first position a full prefill's first round could
            stage from: ``h - K``, or 0 when ``h <= W - B`` (then it stages
            the whole prompt).
        first_row, replay_from: the sequence now holds rows
            ``[first_row, replay_from)``; the server prefills from
            ``replay_from`` (``== n_tokens``: nothing to re-prefill; never
            below ``n_tokens - K``).
        rows: ``replay_from - first_row``.
        origin: the sequence's ``pos_base`` and ``n_cache``: 0, as if it had
            processed every position, except when the store lacked rows deep
            in a short prompt (then ``first_row``: the first round stages at
            least ``K`` rows, from there).
        exact: the first rounds equal a full prefill's (plan and staged rows).
        blocks_found: blocks of the chain the rows came from.
        moves: external-row mode: the copies from the store's table to the
            Stager's ring table (:class:`PrefixMoves`); empty otherwise.
    """

    n_tokens: int
    need_first: int
    first_row: int
    replay_from: int
    rows: int
    origin: int
    exact: bool
    blocks_found: int
    moves: PrefixMoves

    @property
    def replay_tokens(self) -> int:
        """Positions the server must prefill again: ``n_tokens - replay_from`` (at most ``K``)."""
        return self.n_tokens - self.replay_from

    @property
    def complete(self) -> bool:
        """Every row the first round needs was found: nothing to re-prefill."""
        return self.replay_from == self.n_tokens

    def as_dict(self) -> dict[str, Any]:
        """The fields but ``moves`` (for comparisons and JSON)."""
        return {k: getattr(self, k) for k in PREFIX_HIT_FIELDS}


class PrefixHits(list[PrefixHit]):
    """``hit_many``'s result: one :class:`PrefixHit` per sequence, in batch order, and ``moves``:
    the copies of every hit of the batch (external rows: one table change, numbered among the
    Stager's; held mode: empty). The hits' own ``moves`` are empty."""

    def __init__(self, hits: list[PrefixHit], moves: PrefixMoves) -> None:
        super().__init__(hits)
        self.moves = moves
