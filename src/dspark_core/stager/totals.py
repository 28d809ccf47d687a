"""A Stager's metrics at one moment (``Stager.totals()``).

Per sequence, ``Stager.stats(seq)`` counts since the sequence's last
``begin`` and ``Stager.accepted(seq)`` is its histogram of accepted drafts per
verified round. A server wants the same over every request it served, and
counters that never go back (Prometheus derives rates from them), so the
Stager also keeps the counters of sequences whose stats reset (``begin``,
``end``, ``fork`` into a sequence, ``restore``, a prefix start) and adds them
in here. The rules per field, the core's (``DSPARK_SEQ_STATS_GAUGES`` /
``_PEAKS``): a gauge is summed over the sequences holding rows now, a peak is
the largest any sequence reached, every other field is a counter summed over
every sequence since the Stager was made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._ext import _row_format

__all__ = ["StagerTotals", "COUNTERS", "GAUGES", "PEAKS"]

#: The stats fields that are levels (``GAUGES``, ``PEAKS``), and the counters: every other one.
GAUGES: tuple[str, ...] = _row_format.SEQ_STATS_GAUGES
PEAKS: tuple[str, ...] = _row_format.SEQ_STATS_PEAKS
COUNTERS: tuple[str, ...] = tuple(
    name for name in _row_format.SEQ_STATS_FIELDS if name not in GAUGES and name not in PEAKS
)


@dataclass(frozen=True)
class StagerTotals:
    """A Stager's metrics, all read at one moment.

    stats: ``stats(seq)``'s keys, combined over sequences as the module says.
    accepted: int64 ``[block_size + 1]``, the verified rounds with ``k``
    accepted drafts at ``[k]``, over every sequence since the Stager was made
    (``stats["verified_rounds"]`` is its sum, ``stats["accepted_tokens"]``
    its weighted sum). started: the sequences holding rows now. A sequence
    with a reservation open counts as before it (``cancel`` puts it back;
    ``confirm`` makes it count). Sequences handed over to the device step
    count as of their ``to_device`` until ``to_host`` brings their steps back.
    """

    stats: dict[str, int]
    accepted: np.ndarray
    started: int

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StagerTotals):
            return NotImplemented
        return (self.stats == other.stats and self.started == other.started
                and np.array_equal(self.accepted, other.accepted))

    __hash__ = None  # type: ignore[assignment]  # holds a dict and an array
