"""The staging modes compared: absolute staging, windows of ``T``, ``T/8`` and ``T/16``, and the mask check.

* ``absolute``: a window larger than any document, so the Stager never rebases and
  the drafter runs at absolute positions over every row (what a server without
  windowing does);
* ``W=T`` / ``W=T/8`` / ``W=T/16``: windowed staging with rebases, the drafter at
  rebased positions ``[0, W)``;
* ``mask W=T``: the ``W = T`` plans (the same rows) with the drafter run at their
  absolute positions (``position_offset = pos_base``): a window kept as an attention
  mask without the rebase. Offline only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mode", "modes", "LIVE", "OFFLINE"]


@dataclass(frozen=True)
class Mode:
    """A staging mode: its name, window (``None``: absolute) and whether positions stay absolute."""

    name: str
    divisor: int | None  #: W = T // divisor; None: absolute staging
    absolute_positions: bool = False

    def window(self, T: int, n_max: int, block: int) -> int:
        """The Stager's window for drafter range ``T`` and documents of at most ``n_max`` positions."""
        if self.divisor is None:
            return n_max + 2 * block + 2  # never rebases
        return T // self.divisor


ABSOLUTE = Mode("absolute", None)
WINDOWED = Mode("W=T", 1)
SHORT8 = Mode("W=T/8", 8)
SHORT16 = Mode("W=T/16", 16)
MASKED = Mode("mask W=T", 1, absolute_positions=True)

#: The live loop's modes, and the offline evaluation's (the mask check added).
LIVE = (ABSOLUTE, WINDOWED, SHORT8, SHORT16)
OFFLINE = (*LIVE, MASKED)


def modes(names: str) -> tuple[Mode, ...]:
    """Modes by name, comma-separated."""
    by = {m.name: m for m in OFFLINE}
    return tuple(by[n.strip()] for n in names.split(",") if n.strip())
