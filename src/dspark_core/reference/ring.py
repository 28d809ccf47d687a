"""The slot arithmetic of the core's feature ring, without the rows.

:class:`RingModel` is the pure-Python statement of where the C++
``FeatureBuffer`` keeps each row: the reference stager drives it at the same
points the core drives its ring, so that both hand out the same slots (in
plans, from ``process`` in external-row mode) and the same moves (``fork``,
``shift``). It holds no bytes and is written for clarity, not speed.

Invariants (the core's, see csrc/include/dspark/feature_buffer.hpp):

* rows are contiguous in position: the row of position ``p``
  (``head <= p < end``) lives at ring index ``(head_slot + p - head) % cap``;
* ``cap`` is 0 until the first reservation, then ``ring_rows`` for good (the
  Stager's horizon rule never needs more; external rows could not move);
* a ring emptied by ``drop_front`` or ``reset`` starts again at index 0.

Global slots are ``seq * ring_rows + ring index`` (``base`` below).
"""

from __future__ import annotations

__all__ = ["RingModel"]


class RingModel:
    """Head position, head index, row count and capacity of one sequence's ring."""

    __slots__ = ("ring_rows", "cap", "head", "head_slot", "count")

    def __init__(self, ring_rows: int) -> None:
        self.ring_rows = ring_rows
        self.cap = 0
        self.head = 0
        self.head_slot = 0
        self.count = 0

    @property
    def end(self) -> int:
        return self.head + self.count

    def index(self, pos: int) -> int:
        """Ring index of position ``pos`` (``head <= pos < end``)."""
        assert self.head <= pos < self.end or self.count == 0, (pos, self.head, self.end)
        return (self.head_slot + pos - self.head) % self.cap

    def reset(self, pos: int) -> None:
        """Forget every row; the next row appended is at ``pos`` (capacity kept)."""
        self.head, self.head_slot, self.count = pos, 0, 0

    def reserve(self, n: int) -> None:
        """Room for ``n`` more rows: the first reservation takes all ``ring_rows``."""
        need = self.count + n
        if need <= self.cap:
            return
        assert self.cap == 0 and need <= self.ring_rows, "the ring never grows past its bound"
        self.cap, self.head_slot = self.ring_rows, 0

    def append(self, n: int) -> list[int]:
        """Append ``n`` rows (room reserved); returns their ring indices."""
        tail = self.head_slot if self.count == 0 else self.index(self.end - 1) + 1
        out = [(tail + i) % self.cap for i in range(n)]
        self.count += n
        return out

    def drop_front(self, new_head: int) -> None:
        """Drop rows below ``new_head`` (clamped to ``[head, end]``)."""
        new_head = min(max(new_head, self.head), self.end)
        k = new_head - self.head
        if k == 0:
            return
        self.head_slot = 0 if k == self.count else self.index(new_head)
        self.head = new_head
        self.count -= k

    def drop_back(self, new_end: int) -> None:
        """Drop rows at and above ``new_end`` (clamped to ``[head, end]``)."""
        new_end = min(max(new_end, self.head), self.end)
        self.count = new_end - self.head

    def slots(self, lo: int, hi: int, base: int) -> list[int]:
        """Global slots of rows ``[lo, hi)``."""
        return [base + self.index(p) for p in range(lo, hi)]

    def compact(self, frm: int, lo: int, hi: int, new_head: int, base: int) -> list[tuple[int, int, int]]:
        """Keep rows ``[frm, lo)`` and ``[hi, end)``, renumbered from ``new_head``.

        The front rows stay where they are; the tail rows move down to follow
        them, row by row in increasing order (which never overwrites a row
        still to be read). Returned as moves ``(src, dst, count)`` of global
        slots, each a run that does not cross the ring's end and is at most
        ``hi - lo`` rows long, so that its ranges never overlap.
        """
        frm = min(max(frm, self.head), self.end)
        lo = min(max(lo, frm), self.end)
        hi = min(max(hi, lo), self.end)
        n_front, n_gap, n_tail = lo - frm, hi - lo, self.end - hi
        moves: list[tuple[int, int, int]] = []
        if n_front and n_gap and n_tail:
            for i in range(n_tail):
                src, dst = self.index(hi + i), self.index(lo + i)
                last = moves[-1] if moves else None
                if (last is not None and last[0] + last[2] == base + src and last[1] + last[2] == base + dst
                        and last[2] < n_gap):
                    moves[-1] = (last[0], last[1], last[2] + 1)
                else:
                    moves.append((base + src, base + dst, 1))
        first = self.index(frm) if n_front else (self.index(hi) if n_tail else 0)
        self.count = n_front + n_tail
        self.head_slot = first if self.count else 0
        self.head = new_head
        return moves
